//! The `tether` binary: parses arguments and wires the library crates
//! together. No logic lives here.

#![forbid(unsafe_code)]

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::{Parser, Subcommand};
use tether_admin::Shutdown;

#[derive(Parser)]
#[command(
    name = "tether",
    version,
    about = "Tether service mesh: control plane, sidecar proxy and local mesh"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

fn parse_secs(s: &str) -> Result<Duration, String> {
    let v: f64 = s
        .parse()
        .map_err(|_| format!("{s:?} is not a number of seconds"))?;
    if !(0.0..=1e9).contains(&v) {
        return Err(format!("{s} seconds is out of range"));
    }
    Ok(Duration::from_secs_f64(v))
}

/// Bounds of the data-path listeners, shared by `proxy` and `gateway`.
#[derive(clap::Args)]
struct ServeArgs {
    /// Client connections open at once, all listeners together (default:
    /// half the fd limit left after a reserve for admin and control plane).
    #[arg(long)]
    max_connections: Option<usize>,
    /// Seconds a client may take to send a request's HTTP/1 headers.
    #[arg(long, default_value = "10", value_parser = parse_positive_secs)]
    header_read_timeout: Duration,
    /// Seconds a client connection may stay open with no request in flight.
    #[arg(long, default_value = "60", value_parser = parse_positive_secs)]
    idle_timeout: Duration,
    /// Seconds an outbound request may wait for response headers, all
    /// attempts together (504 after it); 0 waits as long as the app takes.
    /// A service's `response_timeout` in the registry overrides it.
    #[arg(long, default_value = "60", value_parser = parse_secs)]
    response_timeout: Duration,
}

impl ServeArgs {
    fn serve_config(&self) -> tether_proxy::serve::ServeConfig {
        tether_proxy::serve::ServeConfig {
            max_connections: self.max_connections,
            header_read_timeout: self.header_read_timeout,
            idle_timeout: self.idle_timeout,
        }
    }

    fn response_timeout(&self) -> Option<Duration> {
        (!self.response_timeout.is_zero()).then_some(self.response_timeout)
    }
}

fn parse_positive_secs(s: &str) -> Result<Duration, String> {
    let d = parse_secs(s)?;
    if d.is_zero() {
        return Err("must be more than 0 seconds".into());
    }
    Ok(d)
}

fn parse_link(s: &str) -> Result<tether_control::multicluster::links::Link, String> {
    tether_control::multicluster::links::parse_flag(s).map_err(|e| e.message)
}

fn parse_upstream(s: &str) -> Result<(SocketAddr, String), String> {
    let (listen, authority) = s
        .split_once('=')
        .ok_or_else(|| format!("{s:?}: expected LISTEN_ADDR=AUTHORITY, e.g. 127.0.0.1:5432=db.demo.svc.cluster.local:5432"))?;
    let listen = listen
        .parse()
        .map_err(|_| format!("{listen:?} is not an address (ip:port)"))?;
    Ok((listen, authority.to_string()))
}

#[derive(Subcommand)]
enum Command {
    /// Run the control plane (Destination, policy) over a registry.
    Control {
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
        link: Vec<tether_control::multicluster::links::Link>,
        /// A YAML file of links (see the README).
        #[arg(long)]
        links: Option<PathBuf>,
        /// Live Destination.Get streams served at most; beyond, Get is refused
        /// (RESOURCE_EXHAUSTED) and proxies try another replica.
        #[arg(long, default_value = "100000", value_parser = clap::value_parser!(u64).range(1..))]
        max_subscriptions: u64,
    },
    /// Run the sidecar proxy.
    Proxy {
        /// Control-plane gRPC address(es), comma-separated, tried in turn.
        #[arg(long, value_delimiter = ',', required = true)]
        control: Vec<String>,
        /// Outbound listener: the app sends requests for mesh services here.
        #[arg(long, default_value = "127.0.0.1:4140")]
        outbound: SocketAddr,
        /// Inbound listener: peer proxies connect here (runs when --app is set).
        #[arg(long, default_value = "0.0.0.0:4143")]
        inbound: SocketAddr,
        /// Admin listener (/live, /ready, /metrics).
        #[arg(long, default_value = "127.0.0.1:4191")]
        admin: SocketAddr,
        /// The local app's address, where inbound traffic goes.
        #[arg(long)]
        app: Option<SocketAddr>,
        /// The app's port is opaque TCP (a database, a server-speaks-first
        /// protocol): inbound connections are forwarded without detection.
        /// Without it the inbound forwards only HTTP and refuses the rest.
        #[arg(long, requires = "app")]
        inbound_opaque: bool,
        /// A local listener pinned to one service: LISTEN=AUTHORITY (repeatable).
        /// Opaque TCP when the service port is opaque, HTTP otherwise.
        #[arg(long, value_parser = parse_upstream)]
        upstream: Vec<(SocketAddr, String)>,
        /// Seconds a request waits for a service to have a ready endpoint.
        #[arg(long, default_value = "3", value_parser = parse_secs)]
        failfast_timeout: Duration,
        /// Seconds to wait for a TCP connection to an endpoint.
        #[arg(long, default_value = "1", value_parser = parse_secs)]
        connect_timeout: Duration,
        /// Seconds in-flight requests get to finish on SIGTERM.
        #[arg(long, default_value = "10", value_parser = parse_secs)]
        drain_timeout: Duration,
        /// This proxy's identity, e.g. web.demo.serviceaccount.identity.cluster.local.
        #[arg(long, requires_all = ["identity_token_file", "trust_root"])]
        identity: Option<String>,
        /// File holding the bootstrap token for --identity.
        #[arg(long)]
        identity_token_file: Option<PathBuf>,
        /// The trust root (PEM) peers' certificates must chain to.
        #[arg(long)]
        trust_root: Option<PathBuf>,
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
        #[command(flatten)]
        serve: ServeArgs,
        /// Authorities (service:port) followed at once, one discovery
        /// subscription each; past it the least recently used idle one is
        /// dropped, and with none idle new authorities get 503.
        #[arg(long, default_value = "1000", value_parser = clap::value_parser!(u64).range(1..))]
        max_discovery_subscriptions: u64,
        /// Seconds a control plane may take to send a discovery stream's first
        /// update before the next --control address is tried.
        #[arg(long, default_value = "1", value_parser = parse_secs)]
        discovery_first_answer_timeout: Duration,
    },
    /// Run the multicluster gateway: mTLS from other clusters to local global services.
    Gateway {
        /// Local control-plane gRPC address(es), comma-separated.
        #[arg(long, value_delimiter = ',', required = true)]
        control: Vec<String>,
        /// Where other clusters' proxies connect (mTLS only).
        #[arg(long, default_value = "0.0.0.0:4180")]
        listen: SocketAddr,
        #[arg(long, default_value = "127.0.0.1:4191")]
        admin: SocketAddr,
        /// The gateway's identity, e.g. tether-gateway.east.serviceaccount.identity.cluster.local.
        #[arg(long)]
        identity: String,
        #[arg(long)]
        identity_token_file: PathBuf,
        #[arg(long)]
        trust_root: PathBuf,
        /// Clients must hold identities of this trust domain.
        #[arg(long, default_value = "cluster.local")]
        trust_domain: String,
        #[arg(long, default_value = "3", value_parser = parse_secs)]
        failfast_timeout: Duration,
        #[arg(long, default_value = "1", value_parser = parse_secs)]
        connect_timeout: Duration,
        #[arg(long, default_value = "10", value_parser = parse_secs)]
        drain_timeout: Duration,
        #[command(flatten)]
        serve: ServeArgs,
    },
    /// Run a whole mesh on this machine from a manifest (the built-in demo without one).
    Up {
        /// Manifest file (YAML); see the README for the format.
        file: Option<PathBuf>,
        /// Run headless for SECS seconds, print a summary, exit non-zero if no request succeeded.
        #[arg(long, value_parser = parse_secs)]
        duration: Option<Duration>,
        /// Seconds between live traffic reports.
        #[arg(long, default_value = "2", value_parser = parse_secs)]
        interval: Duration,
        /// Print the built-in demo manifest and exit.
        #[arg(long)]
        print_demo: bool,
        /// Run the built-in multicluster demo (two clusters, failover).
        #[arg(long, conflicts_with = "file")]
        multicluster: bool,
        /// Also print the summary as a JSON line (`summary-json {...}`).
        #[arg(long)]
        json: bool,
    },
    /// Check the mesh: control planes, replicas, certificates, proxies (a hint per failure).
    Check {
        /// A control-plane gRPC address (repeatable).
        #[arg(long, default_value = "127.0.0.1:8086")]
        control: Vec<String>,
        /// A proxy's admin address (repeatable).
        #[arg(long)]
        proxy: Vec<SocketAddr>,
        /// The identity directory, to check the trust root and issuer.
        #[arg(long)]
        identity: Option<PathBuf>,
        /// The registry directory, to check replicas serve what it says.
        #[arg(long)]
        registry: Option<PathBuf>,
        #[arg(long, default_value = "cluster.local")]
        cluster_domain: String,
    },
    /// Compare what control-plane replicas serve, with each other and the registry.
    Diagnostics {
        #[command(subcommand)]
        command: DiagnosticsCommand,
    },
    /// Print the Kubernetes manifests of the control plane and gateway (`| kubectl apply -f -`).
    Install {
        /// The identity directory from `tether identity init` (its trust root and issuer become Secrets).
        #[arg(long)]
        identity: PathBuf,
        #[arg(long, default_value = "tether-system")]
        namespace: String,
        /// High availability: 3 control-plane replicas, a PodDisruptionBudget, anti-affinity.
        #[arg(long)]
        ha: bool,
        #[arg(long, default_value = concat!("tether:", env!("CARGO_PKG_VERSION")))]
        image: String,
        #[arg(long, default_value = "cluster.local")]
        cluster_domain: String,
    },
    /// Add the proxy (native sidecar) and `tether init` to workload manifests (FILE, or - for stdin).
    Inject {
        #[arg(default_value = "-")]
        file: PathBuf,
        #[arg(long, default_value = concat!("tether:", env!("CARGO_PKG_VERSION")))]
        image: String,
        /// The control plane's namespace.
        #[arg(long, default_value = "tether-system")]
        control_namespace: String,
        #[arg(long, default_value = "cluster.local")]
        cluster_domain: String,
    },
    /// Program iptables for transparent interception (what a sidecar's init container does).
    Init {
        /// The proxy's user id; its own traffic is never redirected.
        #[arg(long, default_value = "1337")]
        proxy_uid: u32,
        #[arg(long, default_value = "4140")]
        outbound_port: u16,
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
        #[arg(long, default_value = "iptables")]
        iptables: String,
        /// Print the iptables commands without running them.
        #[arg(long)]
        dry_run: bool,
    },
    /// Manage the mesh's trust root, issuer and bootstrap tokens.
    Identity {
        #[command(subcommand)]
        command: IdentityCommand,
    },
    /// Run the demo app (HTTP/1.1, HTTP/2 and gRPC).
    DemoApp {
        #[arg(long, default_value = "127.0.0.1:8080")]
        listen: SocketAddr,
        #[arg(long, default_value = "demo")]
        service: String,
        /// The replica name reported in every answer.
        #[arg(long, default_value = "demo-0")]
        replica: String,
        #[arg(long, default_value = "0")]
        latency_ms: f64,
        /// Fraction of requests answered with an error (0 to 1).
        #[arg(long, default_value = "0")]
        error_rate: f64,
    },
    /// Send load: open-loop at --rate, or closed-loop at full speed without it. Prints JSON.
    Load {
        /// Where to connect: an outbound proxy or the app itself.
        #[arg(long)]
        connect: SocketAddr,
        /// The authority requests name (Host / :authority).
        #[arg(long)]
        authority: String,
        #[arg(long, default_value = "/")]
        path: String,
        /// http1, http2 or grpc.
        #[arg(long, default_value = "http1")]
        protocol: tether_mesh_up::loadgen::LoadProtocol,
        /// Requests per second (open loop). Omit for maximum throughput.
        #[arg(long)]
        rate: Option<f64>,
        #[arg(long, default_value = "10", value_parser = parse_secs)]
        duration: Duration,
        #[arg(long, default_value = "64")]
        concurrency: usize,
    },
}

#[derive(Subcommand)]
enum DiagnosticsCommand {
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
        #[arg(long, default_value = "cluster.local")]
        cluster_domain: String,
    },
    /// Each replica's metrics, headed by replica.
    ControllerMetrics {
        #[arg(long, default_value = "127.0.0.1:8086")]
        control: Vec<String>,
        /// Only lines containing this text.
        #[arg(long)]
        filter: Option<String>,
    },
}

#[derive(Subcommand)]
enum IdentityCommand {
    /// Create a trust root and an issuer (ECDSA P-256) and a token secret.
    Init {
        #[arg(long)]
        out: PathBuf,
        #[arg(long, default_value = "cluster.local")]
        trust_domain: String,
        /// Replace existing files.
        #[arg(long)]
        force: bool,
        /// Issuer certificate lifetime in seconds (default one year).
        #[arg(long, default_value = "31536000", value_parser = parse_secs)]
        issuer_lifetime: Duration,
    },
    /// Print the bootstrap token that entitles a workload to IDENTITY.
    Token {
        /// The identity directory (holds token.key).
        #[arg(long)]
        dir: PathBuf,
        identity: String,
    },
}

fn when(t: std::time::SystemTime) -> String {
    let secs = t
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs();
    let days = t
        .duration_since(std::time::SystemTime::now())
        .unwrap_or_default()
        .as_secs_f64()
        / 86400.0;
    format!("unix time {secs} (in {days:.0} days)")
}

/// An identity for a proxy or gateway; a token file that cannot be read
/// is refused at start-up rather than at the first certificate request.
fn identity_config(
    name: String,
    token_file: PathBuf,
    trust_root: PathBuf,
) -> anyhow::Result<tether_proxy::identity::IdentityConfig> {
    let config = tether_proxy::identity::IdentityConfig {
        name,
        token_file,
        trust_root,
    };
    config
        .read_token()
        .map_err(|e| anyhow::anyhow!("--identity-token-file: {e}"))?;
    Ok(config)
}

fn init_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    init_tracing();
    let shutdown = Shutdown::default();
    shutdown.on_signals();
    match cli.command {
        Command::Control {
            registry,
            registry_max_file_bytes,
            kube_api,
            token_audience,
            grpc,
            admin,
            cluster_domain,
            identity,
            identity_leaf_lifetime,
            audit_interval,
            cluster,
            export,
            gateway_address,
            gateway_identity,
            mut link,
            links,
            max_subscriptions,
        } => {
            if let Some(path) = &links {
                let text = std::fs::read_to_string(path)
                    .with_context(|| format!("reading {}", path.display()))?;
                link.extend(tether_control::multicluster::links::parse_file(
                    &text,
                    &path.display().to_string(),
                )?);
            }
            if let Some(c) = &cluster {
                anyhow::ensure!(
                    tether_core::authority::is_dns_label(c),
                    "--cluster {c:?} is not a valid cluster name"
                );
            }
            anyhow::ensure!(
                audit_interval >= Duration::from_millis(10),
                "--audit-interval must be at least 0.01 s"
            );
            anyhow::ensure!(
                identity_leaf_lifetime >= Duration::from_secs(1),
                "--identity-leaf-lifetime must be at least 1 second"
            );
            let config = tether_control::ControlConfig {
                registry: tether_control::RegistrySource::from_flag(
                    &registry,
                    registry_max_file_bytes,
                    kube_api,
                ),
                token_audience,
                grpc_addr: grpc,
                admin_addr: admin,
                cluster_domain,
                identity_dir: identity,
                leaf_lifetime: identity_leaf_lifetime,
                audit_interval,
                cluster,
                multicluster: tether_control::multicluster::MulticlusterConfig {
                    export_addr: export,
                    gateway_address,
                    gateway_identity,
                    links: link,
                },
                max_subscriptions: usize::try_from(max_subscriptions).unwrap_or(usize::MAX),
            };
            tether_control::run(config, shutdown).await?;
        }
        Command::Proxy {
            control,
            outbound,
            inbound,
            admin,
            app,
            inbound_opaque,
            upstream,
            failfast_timeout,
            connect_timeout,
            drain_timeout,
            identity,
            identity_token_file,
            trust_root,
            tls,
            control_plane_unavailable,
            max_pending,
            require_discovery,
            retry_budget_ratio,
            retry_budget_min_per_second,
            serve,
            max_discovery_subscriptions,
            discovery_first_answer_timeout,
        } => {
            anyhow::ensure!(
                retry_budget_ratio >= 0.0 && retry_budget_min_per_second >= 0.0,
                "retry budget settings must not be negative"
            );
            anyhow::ensure!(
                !discovery_first_answer_timeout.is_zero(),
                "--discovery-first-answer-timeout must be more than 0"
            );
            let identity = match (identity, identity_token_file, trust_root) {
                (Some(name), Some(token_file), Some(trust_root)) => {
                    Some(identity_config(name, token_file, trust_root)?)
                }
                _ => None,
            };
            let discovery = tether_proxy::discovery::DiscoverySettings {
                first_answer_timeout: discovery_first_answer_timeout,
            };
            let config = tether_proxy::ProxyConfig {
                bootstrap: tether_proxy::bootstrap::BootstrapConfig {
                    control,
                    admin,
                    identity,
                    tls_mode: tls,
                    connect_timeout,
                    drain_timeout,
                    discovery,
                    serve: serve.serve_config(),
                },
                outbound_listen: outbound,
                upstreams: upstream,
                require_discovery,
                outbound: tether_proxy::outbound::OutboundConfig {
                    failfast_timeout,
                    max_pending,
                    control_plane_unavailable,
                    retry_budget: tether_proxy::retry::BudgetSpec {
                        ratio: retry_budget_ratio,
                        min_per_second: retry_budget_min_per_second,
                        ttl: Duration::from_secs(10),
                    },
                    response_timeout: serve.response_timeout(),
                    max_subscriptions: usize::try_from(max_discovery_subscriptions)
                        .unwrap_or(usize::MAX),
                },
                inbound: app.map(|app| tether_proxy::inbound::InboundConfig {
                    listen: inbound,
                    app,
                    opaque: inbound_opaque,
                }),
            };
            tether_proxy::run(config, shutdown).await?;
        }
        Command::Gateway {
            control,
            listen,
            admin,
            identity,
            identity_token_file,
            trust_root,
            trust_domain,
            failfast_timeout,
            connect_timeout,
            drain_timeout,
            serve,
        } => {
            let config = tether_proxy::gateway::GatewayConfig {
                bootstrap: tether_proxy::bootstrap::BootstrapConfig {
                    control,
                    admin,
                    identity: Some(identity_config(identity, identity_token_file, trust_root)?),
                    tls_mode: tether_proxy::tls::TlsMode::Mandatory,
                    connect_timeout,
                    drain_timeout,
                    discovery: Default::default(),
                    serve: serve.serve_config(),
                },
                listen,
                trust_domain,
                outbound: tether_proxy::outbound::OutboundConfig {
                    failfast_timeout,
                    // Requests from a whole remote cluster may wait here.
                    max_pending: 1000,
                    response_timeout: serve.response_timeout(),
                    ..Default::default()
                },
            };
            tether_proxy::gateway::run(config, shutdown).await?;
        }
        Command::Up {
            file,
            duration,
            interval,
            print_demo,
            multicluster,
            json,
        } => {
            if print_demo {
                let demo = if multicluster {
                    tether_mesh_up::manifest::MULTICLUSTER_DEMO
                } else {
                    tether_mesh_up::manifest::DEMO
                };
                print!("{}", demo.trim_start());
                return Ok(());
            }
            let manifest = match &file {
                Some(path) => tether_mesh_up::manifest::Manifest::load(path)?,
                None if multicluster => tether_mesh_up::manifest::Manifest::multicluster_demo(),
                None => tether_mesh_up::manifest::Manifest::demo(),
            };
            let config = tether_mesh_up::up::UpConfig {
                exe: std::env::current_exe().context("locating the tether binary")?,
                manifest,
                duration,
                interval,
                json,
            };
            let outcome = tether_mesh_up::up::run(config, shutdown).await?;
            if duration.is_some() && outcome.report.succeeded == 0 {
                anyhow::bail!("no request succeeded");
            }
        }
        Command::Check {
            control,
            proxy,
            identity,
            registry,
            cluster_domain,
        } => {
            let ok = tether_ops::check::run(&tether_ops::check::CheckOptions {
                controls: control,
                proxies: proxy,
                identity,
                registry,
                cluster_domain,
            })
            .await?;
            anyhow::ensure!(ok, "some checks failed");
        }
        Command::Diagnostics { command } => match command {
            DiagnosticsCommand::Endpoints {
                authority,
                control,
                registry,
                cluster_domain,
            } => {
                let agree = tether_ops::diagnostics::endpoints(
                    &authority,
                    &control,
                    registry.as_ref(),
                    &cluster_domain,
                )
                .await?;
                anyhow::ensure!(agree, "the views differ");
            }
            DiagnosticsCommand::ControllerMetrics { control, filter } => {
                let ok = tether_ops::diagnostics::controller_metrics(&control, filter.as_deref())
                    .await?;
                anyhow::ensure!(ok, "some replicas could not be read");
            }
        },
        Command::Install {
            identity,
            namespace,
            ha,
            image,
            cluster_domain,
        } => {
            print!(
                "{}",
                tether_ops::kube::install(&tether_ops::kube::InstallOptions {
                    namespace,
                    image,
                    ha,
                    identity_dir: identity,
                    cluster_domain,
                })?
            );
        }
        Command::Inject {
            file,
            image,
            control_namespace,
            cluster_domain,
        } => {
            let input = tether_ops::kube::read_input(&file)?;
            print!(
                "{}",
                tether_ops::kube::inject(
                    &input,
                    &tether_ops::kube::InjectOptions {
                        image,
                        control_namespace,
                        cluster_domain,
                    }
                )?
            );
        }
        Command::Init {
            proxy_uid,
            outbound_port,
            inbound_port,
            skip_inbound_ports,
            skip_outbound_ports,
            outbound_only,
            iptables,
            dry_run,
        } => {
            tether_ops::init::run(&tether_ops::init::InitOptions {
                iptables,
                proxy_uid,
                outbound_port,
                inbound_port,
                skip_inbound_ports,
                skip_outbound_ports,
                inbound: !outbound_only,
                dry_run,
            })?;
        }
        Command::Identity { command } => match command {
            IdentityCommand::Init {
                out,
                trust_domain,
                force,
                issuer_lifetime,
            } => {
                let mut opts = tether_identity::ca::InitOptions::new(&out, &trust_domain);
                opts.force = force;
                opts.issuer_lifetime = issuer_lifetime;
                let report = tether_identity::ca::init(&opts)?;
                println!("created trust root and issuer for trust domain {trust_domain}:");
                for f in &report.files {
                    println!("  {}", f.display());
                }
                println!("trust root expires at {}", when(report.root_expires));
                println!("issuer expires at     {}", when(report.issuer_expires));
                println!(
                    "give {} to every proxy (--trust-root); keep ca.key offline",
                    out.join("ca.crt").display()
                );
            }
            IdentityCommand::Token { dir, identity } => {
                let tokens = tether_identity::token::LocalTokens::load(&dir)
                    .with_context(|| format!("reading the token secret in {}", dir.display()))?;
                println!("{}", tokens.issue(&identity));
            }
        },
        Command::DemoApp {
            listen,
            service,
            replica,
            latency_ms,
            error_rate,
        } => {
            anyhow::ensure!(latency_ms >= 0.0, "--latency-ms must be at least 0");
            anyhow::ensure!(
                (0.0..=1.0).contains(&error_rate),
                "--error-rate must be between 0 and 1"
            );
            let config = tether_mesh_up::demo_app::DemoConfig {
                service,
                replica,
                latency: Duration::from_secs_f64(latency_ms / 1000.0),
                error_rate,
            };
            tether_mesh_up::demo_app::run(listen, config, shutdown).await?;
        }
        Command::Load {
            connect,
            authority,
            path,
            protocol,
            rate,
            duration,
            concurrency,
        } => {
            if let Some(r) = rate {
                anyhow::ensure!(r > 0.0, "--rate must be above 0");
            }
            let spec = tether_mesh_up::loadgen::LoadSpec {
                connect,
                authority,
                path,
                protocol,
                rate,
                duration,
                concurrency,
            };
            let report = tether_mesh_up::loadgen::run(spec, shutdown).await?;
            println!("{}", report.to_json());
        }
    }
    Ok(())
}
