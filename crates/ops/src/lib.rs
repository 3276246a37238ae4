//! Operator tools.
//!
//! - [`diagnostics`]: `tether diagnostics endpoints` (each control-plane
//!   replica's view of a service, the differences between replicas and
//!   against the registry) and `tether diagnostics controller-metrics`.

pub mod diagnostics;
