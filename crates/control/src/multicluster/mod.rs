//! Multicluster: links to other clusters and the export API between them.
//!
//! - [`links`]: what a link names (a remote cluster's export address,
//!   gateway, priority tier and trust root), from a file or flags.
//! - [`export`]: `tether.multicluster.v1.Export`, served over mTLS: for each
//!   exported global id, this cluster's ready-endpoint count, with its
//!   gateway's address and identity, re-sent every 250 ms (the heartbeat).
//! - [`remote`]: one watcher per link, which follows the remote's export
//!   stream and probes its gateway, and puts the remote into the index
//!   only while both are reachable (dropped within about a second).
//! - [`tls`]: the control plane's own certificate, for the export API, and
//!   a TLS acceptor that tonic can serve from.

pub mod export;
pub mod links;
pub mod remote;
pub mod tls;

/// The identity a cluster's control plane presents on the export API.
pub fn control_identity(cluster: &str, trust_domain: &str) -> String {
    tether_identity::identity_name("tether-control", cluster, trust_domain)
}
