//! Transparent interception: connections that iptables redirected to the
//! outbound listener (`tether init`) carry their original destination,
//! which the kernel keeps for `getsockopt(SO_ORIGINAL_DST)`.

use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::os::fd::AsRawFd;

use tokio::net::TcpStream;

/// The destination the client dialled, if the connection was redirected
/// (IPv4 only, as `iptables` redirects).
pub fn original_dst(stream: &TcpStream) -> Option<SocketAddr> {
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
    let dst = SocketAddr::V4(SocketAddrV4::new(ip, u16::from_be(addr.sin_port)));
    // Not redirected: the original destination is the listener itself.
    (Some(dst) != stream.local_addr().ok()).then_some(dst)
}
