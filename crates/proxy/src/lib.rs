//! The Tether sidecar proxy.
//!
//! Outbound (app → mesh) and inbound (mesh → app) are separate trees that
//! share the pieces below them:
//!
//! - [`sidecar`] and [`gateway`] are the two processes; [`bootstrap`] is
//!   the start-up they share (control planes, metrics, readiness, TLS,
//!   admin, certificate renewal).
//! - [`outbound`]: the outbound listener, as steps (accept → logical
//!   service → route and retries → endpoint). Names the target service by
//!   the request's authority, resolves it through [`discovery`], picks an
//!   endpoint with the [`balance`]r and forwards over a pooled [`client`]
//!   connection. Also the `--upstream` listeners, which pin one service per
//!   local port.
//! - [`intercept`]: the original destination of connections iptables
//!   redirected to the outbound listener (`tether init`).
//! - [`inbound`]: the inbound listener. [`detect`]s the protocol on the first
//!   bytes and forwards HTTP to the local app (or, on a port declared
//!   opaque, TCP without detection); anything else is refused.
//! - [`authz`]: the inbound authorization policy (default policies, audit),
//!   and [`inbound_policy`], the control plane's policy for the port.
//! - [`discovery`]: one `Destination.Get` stream per authority, shared by
//!   every connection that uses it, reconnecting with backoff across
//!   control-plane replicas, re-subscribing when a stream stalls.
//! - [`gateway`]: the multicluster gateway — an outbound proxy behind an
//!   mTLS listener that admits only the mesh's identities and global ids.
//! - [`failfast`]: how long a service may have no endpoint before its
//!   requests fail at once.
//! - [`balance`]: power of two choices over peak-EWMA latency, within the
//!   best priority tier that has a healthy endpoint.
//! - [`health`]: passive health — endpoints that refuse connections or
//!   fail repeatedly are taken out at once, probed, and readmitted.
//! - [`client`]: connections to one endpoint: one multiplexed HTTP/2
//!   connection, or a bounded pool of HTTP/1 connections.
//! - [`http`]: what both sides do to HTTP messages (hop-by-hop headers,
//!   protocol upgrade between proxies, error responses).
//! - [`retry`]: retries of idempotent requests on another endpoint, within
//!   a budget.
//! - [`serve`]: accept loops and HTTP connections with their bounds:
//!   connection cap, idle and header-read timeouts, graceful shutdown.
//! - [`identity`]: the proxy's certificate: key and CSR made in memory,
//!   certified by the control plane, renewed before expiry.
//! - [`tls`]: when a connection between proxies is mTLS, plaintext, or
//!   refused (`--tls opportunistic|mandatory`).
//! - [`transport_header`]: linkerd2-proxy's opaque transport header, which
//!   names the target port of an mTLS connection to a peer's inbound.
//! - [`upgrade`]: HTTP/1.1 upgrades (WebSocket): the two upgraded
//!   connections joined into one bounded tunnel.
//! - [`classify`]: counts a response once its outcome is known (gRPC's
//!   status comes in the trailers).
//! - [`metrics`]: request counts, latency histograms, open connections.
//! - [`tap`]: the tap API, a live and bounded stream of the requests the
//!   proxy handles (`tether tap`).

pub mod authz;
pub mod balance;
pub mod bootstrap;
pub mod classify;
pub mod client;
pub mod detect;
pub mod discovery;
pub mod errors;
pub mod failfast;
pub mod gateway;
pub mod h2_stream;
pub mod health;
pub mod http;
pub mod identity;
pub mod inbound;
pub mod inbound_policy;
pub mod intercept;
pub mod metrics;
pub mod outbound;
pub mod policy;
pub mod replay;
pub mod retry;
pub mod serve;
pub mod sidecar;
pub mod tap;
pub mod tls;
pub mod transport_header;
pub mod upgrade;
pub mod wait;

pub use sidecar::{run, ProxyConfig};

#[derive(Debug, thiserror::Error)]
pub enum ProxyStartError {
    #[error(transparent)]
    Bind(#[from] tether_admin::BindError),
    #[error("invalid control-plane address {0:?}: expected host:port")]
    ControlAddr(String),
    #[error("no control-plane address given")]
    NoControl,
    #[error("--tls mandatory needs an identity (--identity, --identity-token-file, --trust-root)")]
    MandatoryWithoutIdentity,
    #[error("--control-plane-unavailable=forward sends plaintext to original destinations, which --tls mandatory forbids; use --tls opportunistic or --control-plane-unavailable=fail")]
    ForwardWithMandatoryTls,
    #[error("TLS to the control plane verifies it against the trust root: give --identity, --identity-token-file and --trust-root, or --insecure-control-plane for plaintext")]
    ControlTlsWithoutIdentity,
    #[error("--control-identity not given and {0:?} names no trust domain to derive it from")]
    ControlIdentity(String),
    #[error("identity: {0}")]
    Tls(#[from] tether_identity::tls::TlsError),
}

/// A future boxed where it is made. `Box::pin(step(..))` makes the future
/// on the stack, then copies all of it into the box: the size of its
/// largest state (KiBs for a request's steps), though a future not yet
/// polled holds only its arguments, so a `memcpy` per box and request.
/// Written into a box allocated first, the future is made in place
/// (~0.6k instructions per request fewer in the client proxy, ~0.2k in the
/// server proxy, counted with callgrind).
pub(crate) fn boxed<F: std::future::Future>(make: impl FnOnce() -> F) -> std::pin::Pin<Box<F>> {
    Box::into_pin(Box::write(Box::new_uninit(), make()))
}
