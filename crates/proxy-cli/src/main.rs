//! `tether-proxy`: the sidecar proxy alone, with `tether proxy`'s flags
//! and behaviour, in a binary without the control plane, the Kubernetes
//! client or the operator tools (docs/proxy.md).

use clap::Parser;
use tether_admin::Shutdown;
use tether_proxy_cli::proxy::ProxyArgs;

#[derive(Parser)]
#[command(
    name = "tether-proxy",
    version,
    about = "Tether's sidecar proxy (the same as `tether proxy`)"
)]
struct Cli {
    #[command(flatten)]
    proxy: ProxyArgs,
}

// Before `main`: a build for a newer x86-64 level refuses, saying why, on
// a CPU without it (crates/proxy-cli/src/cpu.rs).
tether_proxy_cli::cpu_guard!();

/// Freed blocks of 1-16 KiB are kept per thread for the next request
/// (see the module): glibc's malloc stays for the rest.
#[global_allocator]
static ALLOCATOR: tether_proxy_cli::alloc::BlockCache = tether_proxy_cli::alloc::BlockCache;

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    tether_proxy_cli::init_tracing();
    let runtime = tether_proxy_cli::runtime::build(Some(cli.proxy.worker_threads()))?;
    runtime.block_on(async {
        let shutdown = Shutdown::default();
        shutdown.on_signals();
        cli.proxy.run(shutdown).await
    })
}
