//! Shared vocabulary of Tether. This crate does no I/O.
//!
//! - [`authority`]: service authorities (`name.namespace.svc.cluster.local:port`)
//!   and how they are parsed, by the control plane and the proxy alike.
//! - [`registry`]: the registry document model (services and their
//!   endpoints) and its validation, shared by the file registry that reads it
//!   and by `tether up`, which writes it.
//! - [`prom`]: a small reader of the Prometheus text format, for the operator
//!   tools that scrape Tether's own admin endpoints.

pub mod authority;
pub mod prom;
pub mod registry;
