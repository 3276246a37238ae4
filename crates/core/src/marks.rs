//! The packet marks `tether init --mode tproxy` and the proxy agree on.
//! Without connection tracking, each packet is judged on its own, so the
//! proxy's own packets must say whose they are even after the socket that
//! sent them is closed (a segment retransmitted, a FIN queued behind data):
//! the socket's mark outlives its owner, which the kernel forgets at close.

/// Set (`SO_MARK`) on every socket the proxy's data path opens or accepts
/// in transparent mode; `tether init` leaves packets carrying it alone.
pub const PROXY_OWN_MARK: u32 = 0x1000;

/// Set by `tether init` on the app's outbound packets to divert them:
/// a routing rule sends them to the loopback, where TPROXY hands them to
/// the outbound listener.
pub const DIVERT_MARK: u32 = 0x2000;

/// The routing table of that rule (one route: every address is local).
pub const DIVERT_TABLE: u32 = 0x2000;
