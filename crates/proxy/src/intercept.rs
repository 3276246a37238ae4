//! Transparent interception. Connections `tether init` sends to the
//! proxy's listeners carry the destination the client dialled:
//! - redirected (`--mode redirect`, iptables NAT): the kernel keeps it for
//!   `getsockopt(SO_ORIGINAL_DST)`, and the socket's own address is the
//!   listener's;
//! - diverted (`--mode tproxy`, iptables TPROXY, no connection tracking):
//!   the socket's own address *is* the destination, which a listener can
//!   accept only when it is transparent ([`bind_transparent`]). With no
//!   connection tracking, `tether init` tells the proxy's packets from the
//!   app's by their mark: every socket the proxy then opens or accepts
//!   carries [`PROXY_OWN_MARK`] ([`tether_identity::own_socket`]).

use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::os::fd::AsRawFd;

use tether_core::marks::PROXY_OWN_MARK;
use tether_identity::own_socket::{needs_capability, set_mark, socket_for};

use tether_admin::{announce, BindError};
use tokio::net::{TcpListener, TcpStream};

/// The destination the client dialled, if the connection was redirected
/// or diverted to the listener at `listening` (IPv4 only, as `tether init`
/// programs iptables only).
pub fn original_dst(stream: &TcpStream, listening: SocketAddr) -> Option<SocketAddr> {
    let local = stream.local_addr().ok()?;
    // First: where the kernel tracks connections anyway (another rule
    // needs it), a diverted connection's tracked destination is its own
    // address, which the check below would take for "not redirected".
    if diverted(local, listening) {
        return Some(local);
    }
    // Not redirected: the original destination is the listener itself.
    redirected_dst(stream).filter(|dst| *dst != local)
}

/// Whether a connection accepted at `local` by the listener bound to
/// `listening` was diverted to it: only a transparent listener accepts
/// connections for another address. A listener on 0.0.0.0 accepts any of
/// the host's addresses on its port, so there only another port tells:
/// a connection diverted from a remote address on the listener's own port
/// is then served as if dialled explicitly, never forwarded back to the
/// proxy itself.
fn diverted(local: SocketAddr, listening: SocketAddr) -> bool {
    local.port() != listening.port()
        || (!listening.ip().is_unspecified() && local.ip() != listening.ip())
}

/// `SO_ORIGINAL_DST`: set by the NAT of a redirect, absent otherwise.
fn redirected_dst(stream: &TcpStream) -> Option<SocketAddr> {
    // SAFETY: sockaddr_in is plain integers, for which all-zero bytes are a
    // valid value.
    let mut addr: libc::sockaddr_in = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
    // SAFETY: the fd is an open socket borrowed from `stream` for the call,
    // and the kernel writes at most `len` bytes, the size of `addr`.
    let rc = unsafe {
        libc::getsockopt(
            stream.as_raw_fd(),
            libc::SOL_IP,
            libc::SO_ORIGINAL_DST,
            &mut addr as *mut libc::sockaddr_in as *mut libc::c_void,
            &mut len,
        )
    };
    if rc != 0 || addr.sin_family != libc::AF_INET as libc::sa_family_t {
        return None;
    }
    let ip = Ipv4Addr::from(u32::from_be(addr.sin_addr.s_addr));
    Some(SocketAddr::V4(SocketAddrV4::new(
        ip,
        u16::from_be(addr.sin_port),
    )))
}

/// Binds a transparent listener (`IP_TRANSPARENT`), which accepts the
/// connections iptables' TPROXY diverts to it whatever address they were
/// for, and announces it as [`tether_admin::bind`] does. It and the
/// connections it accepts carry [`PROXY_OWN_MARK`]. Setting either option
/// needs `CAP_NET_RAW` (`CAP_NET_ADMIN` before Linux 5.17, for `SO_MARK`);
/// without it the error says so.
pub async fn bind_transparent(
    what: &'static str,
    addr: SocketAddr,
) -> Result<TcpListener, BindError> {
    let err = |source| BindError { what, addr, source };
    let socket = socket_for(addr).map_err(err)?;
    socket.set_reuseaddr(true).map_err(err)?;
    let options = socket2::SockRef::from(&socket);
    let (option, set) = match addr {
        SocketAddr::V4(_) => ("IP_TRANSPARENT", options.set_ip_transparent_v4(true)),
        SocketAddr::V6(_) => ("IPV6_TRANSPARENT", options.set_ip_transparent_v6(true)),
    };
    set.map_err(|e| needs_capability(option, e)).map_err(err)?;
    // Accepted connections inherit the mark, and so do their handshakes'
    // replies and the resets the listener sends.
    set_mark(&socket, PROXY_OWN_MARK).map_err(err)?;
    socket.bind(addr).map_err(err)?;
    let listener = socket.listen(1024).map_err(err)?;
    announce(what, listener.local_addr().unwrap_or(addr));
    Ok(listener)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn a(s: &str) -> SocketAddr {
        s.parse().unwrap()
    }

    #[test]
    fn only_another_address_or_port_than_the_listener_s_is_diverted() {
        let on_loopback = a("127.0.0.1:4140");
        assert!(diverted(a("10.96.0.10:80"), on_loopback));
        assert!(diverted(a("10.96.0.10:4140"), on_loopback));
        assert!(!diverted(on_loopback, on_loopback));
        // On every address: any of the host's addresses on its own port
        // may be a client dialling it, and is served as such.
        let anywhere = a("0.0.0.0:4143");
        assert!(!diverted(a("10.1.2.3:4143"), anywhere));
        assert!(diverted(a("10.1.2.3:8080"), anywhere));
    }

    #[tokio::test]
    async fn a_connection_dialled_to_the_listener_has_no_original_destination() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let at = listener.local_addr().unwrap();
        let _client = TcpStream::connect(at).await.unwrap();
        let (stream, _) = listener.accept().await.unwrap();
        assert_eq!(original_dst(&stream, at), None);
    }

    #[tokio::test]
    async fn a_transparent_listener_needs_a_capability_or_binds() {
        match bind_transparent("outbound", a("127.0.0.1:0")).await {
            // As root (CI): bound, and plain connections still work.
            Ok(listener) => {
                let at = listener.local_addr().unwrap();
                let _client = TcpStream::connect(at).await.unwrap();
                let (stream, _) = listener.accept().await.unwrap();
                assert_eq!(original_dst(&stream, at), None);
            }
            Err(e) => {
                let text = e.to_string();
                assert!(
                    text.contains("binding outbound listener")
                        && text.contains("needs CAP_NET_RAW"),
                    "{text}"
                );
            }
        }
    }
}
