//! Operator tools.
//!
//! - [`diagnostics`]: `tether diagnostics endpoints` (each control-plane
//!   replica's view of a service, the differences between replicas and
//!   against the registry) and `tether diagnostics controller-metrics`.
//! - [`init`]: `tether init`, the iptables rules of transparent interception.

pub mod diagnostics;
pub mod init;
