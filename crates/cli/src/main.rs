//! The `tether` binary: parses arguments and wires the library crates
//! together. No logic lives here: each subcommand's flags, and the
//! configuration they make, are in its module under [`cmd`].

mod cmd;

use clap::{Parser, Subcommand};
use tether_admin::Shutdown;

use cmd::{control, dashboard, demo, gateway, identity, ops, proxy, stat, tap, up};

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

#[derive(Subcommand)]
enum Command {
    /// Run the control plane (Destination, policy) over a registry.
    Control(control::ControlArgs),
    /// Run the sidecar proxy.
    Proxy(Box<proxy::ProxyArgs>),
    /// Run the multicluster gateway: mTLS from other clusters to local global services.
    Gateway(gateway::GatewayArgs),
    /// Run a whole mesh on this machine from a manifest (the built-in demo without one).
    Up(up::UpArgs),
    /// Check the mesh: control planes, replicas, certificates, proxies (a hint per failure).
    Check(ops::CheckArgs),
    /// Success rate, RPS, p50/p95/p99 latency and mTLS share per service, workload or route.
    Stat(stat::StatArgs),
    /// Watch requests through proxies live (method, path, status, latency, identities, endpoint).
    Tap(tap::TapArgs),
    /// Serve a live web dashboard of the mesh (topology, golden metrics, endpoints, failover, control plane).
    Dashboard(dashboard::DashboardArgs),
    /// Compare what control-plane replicas serve, with each other and the registry.
    Diagnostics {
        #[command(subcommand)]
        command: ops::DiagnosticsCommand,
    },
    /// Print the Kubernetes manifests of the control plane and gateway (`| kubectl apply -f -`).
    Install(ops::InstallArgs),
    /// Add the proxy (native sidecar) and `tether init` to workload manifests (FILE, or - for stdin).
    Inject(ops::InjectArgs),
    /// Program iptables for transparent interception (what a sidecar's init container does).
    Init(ops::InitArgs),
    /// Manage the mesh's trust root, issuer and bootstrap tokens.
    Identity {
        #[command(subcommand)]
        command: identity::IdentityCommand,
    },
    /// Run the demo app (HTTP/1.1, HTTP/2 and gRPC).
    DemoApp(demo::DemoAppArgs),
    /// Send load: open-loop at --rate, or closed-loop at full speed without it. Prints JSON.
    Load(demo::LoadArgs),
}

/// Freed blocks of 1-16 KiB are kept per thread for the next request
/// (see the module): glibc's malloc stays for the rest.
#[global_allocator]
static ALLOCATOR: tether_proxy_cli::alloc::BlockCache = tether_proxy_cli::alloc::BlockCache;

// Before `main`: a build for a newer x86-64 level refuses, saying why, on
// a CPU without it (crates/proxy-cli/src/cpu.rs).
tether_proxy_cli::cpu_guard!();

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    tether_proxy_cli::init_tracing();
    // The data path runs on a sidecar's share of the host, not on every core.
    let data_path_workers = match &cli.command {
        Command::Proxy(args) => Some(args.worker_threads()),
        Command::Gateway(args) => Some(args.worker_threads()),
        _ => None,
    };
    let runtime = tether_proxy_cli::runtime::build(data_path_workers)?;
    runtime.block_on(run(cli))
}

async fn run(cli: Cli) -> anyhow::Result<()> {
    let shutdown = Shutdown::default();
    shutdown.on_signals();
    match cli.command {
        Command::Control(args) => args.run(shutdown).await,
        Command::Proxy(args) => args.run(shutdown).await,
        Command::Gateway(args) => args.run(shutdown).await,
        Command::Up(args) => args.run(shutdown).await,
        Command::Check(args) => args.run().await,
        Command::Stat(args) => args.run().await,
        Command::Tap(args) => args.run().await,
        Command::Dashboard(args) => args.run(shutdown).await,
        Command::Diagnostics { command } => command.run().await,
        Command::Install(args) => args.run(),
        Command::Inject(args) => args.run(),
        Command::Init(args) => args.run(),
        Command::Identity { command } => command.run(),
        Command::DemoApp(args) => args.run(shutdown).await,
        Command::Load(args) => args.run(shutdown).await,
    }
}
