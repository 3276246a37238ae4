//! Seeing the mesh as a whole, from the metrics every process already
//! serves on its admin listener.
//!
//! - [`state`]: the mesh state file `tether up` writes (which processes run,
//!   their admin addresses, workloads, clusters), so the tools below find
//!   the mesh with no configuration.
//! - [`scrape`]: plain HTTP GETs of admin endpoints, bounded in time and size.
//! - [`stat`]: golden metrics (success rate, RPS, latency percentiles, mTLS
//!   share) per service, workload or route, from two scrapes or from a
//!   Prometheus.
//! - [`tap`]: `tether tap`, following proxies' tap APIs.
//! - [`dashboard`]: `tether dashboard`, a live web page of the mesh.

#![forbid(unsafe_code)]

pub mod dashboard;
pub mod prometheus;
pub mod scrape;
pub mod stat;
pub mod state;
pub mod tap;
