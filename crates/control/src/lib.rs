//! The Tether control plane.
//!
//! Data flows one way: a registry backend watches the source of truth
//! ([`registry`]) and writes whole services into the [`index`]; the index
//! keeps one latest-state slot per (service, port); each `Destination.Get`
//! subscriber has its own task that sends the diff between what it last sent
//! and the slot's current state ([`destination`]). Nothing in that path waits
//! on a subscriber, so a slow proxy never delays the index or other proxies.
//!
//! - [`server`]: wires listeners, the registry, the gRPC services and admin.
//! - [`channel`]: TLS on the gRPC port, and which APIs need mutual TLS.
//! - [`identity`]: `Identity.Certify`, signing workloads' CSRs with the
//!   issuer once their bootstrap token checks out.
//! - [`policy`]: `OutboundPolicies` (each service port's routes, as
//!   [`outbound`] builds them) and the bounded streams policy APIs share.
//! - [`inbound_policy`]: `InboundServerPolicies`, a workload port's
//!   authorization policy from the registry's policy resources.
//! - [`metrics`]: the control plane's Prometheus metrics.
//! - [`diagnostics`]: Tether's own gRPC API for operator tools.
//! - [`multicluster`]: links to other clusters, and the export API.
//! - [`memory`]: returning what large frees leave to the operating system.

pub mod channel;
pub mod destination;
pub mod diagnostics;
pub mod endpoints;
pub mod identity;
pub mod inbound_policy;
pub mod index;
pub mod memory;
pub mod metrics;
pub mod multicluster;
pub mod outbound;
pub mod policy;
pub mod registry;
pub mod server;

pub use registry::source::RegistrySource;
pub use server::{run, ConfigError, ControlConfig, ControlError};

/// xorshift for the randomised tests: the same sequence on every run;
/// each call gives a number below its argument.
#[cfg(test)]
pub(crate) fn test_rng(mut seed: u64) -> impl FnMut(u64) -> u64 {
    move |below| {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed % below
    }
}
