//! Operator tools.
//!
//! - [`diagnostics`]: `tether diagnostics endpoints` (each control-plane
//!   replica's view of a service, the differences between replicas and
//!   against the registry) and `tether diagnostics controller-metrics`.
//! - [`check`]: `tether check`, the mesh's health with a hint per failure.
//! - [`control`]: how the tools reach the control plane (TLS, or plaintext).
//! - [`kube`]: `tether install` and `tether inject`, Kubernetes manifests.
//! - [`init`]: `tether init`, the iptables rules of transparent interception.

#![forbid(unsafe_code)]

pub mod check;
pub mod control;
pub mod diagnostics;
pub mod init;
pub mod kube;
