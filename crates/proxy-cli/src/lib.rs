//! The sidecar proxy's command line, shared by two binaries: `tether-proxy`
//! (this crate's, the proxy alone: what a pod's sidecar and `tether up`
//! run) and `tether proxy` (a subcommand of the full binary). Both parse
//! the same flags ([`proxy::ProxyArgs`]), log the same way
//! ([`init_tracing`]) and run on the same runtime ([`runtime`]).
//!
//! This crate depends on the proxy and what it needs, never on the control
//! plane, the Kubernetes client or the operator tools: their code would
//! land in the proxy's binary and, through fault-around, in its resident
//! memory (docs/performance.md, "A proxy-only binary").

pub mod alloc;
pub mod args;
pub mod cpu;
pub mod memory;
pub mod proxy;
pub mod runtime;

/// Logs to stderr (stdout carries the `listening NAME ADDR` lines), at
/// `RUST_LOG`'s levels, `info` without it.
pub fn init_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
}
