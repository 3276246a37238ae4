//! Shared vocabulary of Tether. This crate does no I/O but [`file`]'s
//! bounded read.
//!
//! - [`authority`]: service authorities (`name.namespace.svc.cluster.local:port`)
//!   and how they are parsed, by the control plane and the proxy alike.
//! - [`registry`]: the registry document model (services and their
//!   endpoints) and its validation, shared by the file registry that reads it
//!   and by `tether up`, which writes it.
//! - [`route`]: Gateway API `HTTPRoute`/`GRPCRoute` documents attached to a
//!   service, their validation, and the bounded regex compiler both sides use.
//! - [`policy`]: authorization policy resources (`Server`,
//!   `AuthorizationPolicy`, authentications, namespace defaults), Linkerd's.
//! - [`backoff`]: jittered exponential backoff, calculated (callers sleep).
//! - [`log_limit`]: at most one log line per interval for conditions a
//!   client can repeat at will.
//! - [`marks`]: the packet marks `tether init --mode tproxy` and the proxy
//!   agree on.
//! - [`truncate`]: bounded echoes of untrusted input (a prefix plus the
//!   length), for every log line, error and operator output that quotes it.
//! - [`yaml`]: YAML anchors and aliases refused before parsing (alias bombs).
//! - [`file`]: an operator's file read with a bound on its size (the
//!   registry's files, the trust bundle).
//! - [`prom`]: a small reader of the Prometheus text format, for the operator
//!   tools that scrape Tether's own admin endpoints.

#![forbid(unsafe_code)]

pub mod authority;
pub mod backoff;
pub mod file;
pub mod log_limit;
pub mod marks;
pub mod policy;
pub mod prom;
pub mod registry;
pub mod route;
pub mod truncate;
pub mod yaml;
