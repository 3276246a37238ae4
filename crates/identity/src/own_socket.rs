//! The connections this process opens, marked as its own in transparent
//! mode. `tether init --mode tproxy` tracks no connection: it tells the
//! proxy's packets from the app's by their mark ([`PROXY_OWN_MARK`]). A
//! socket's mark outlives its user, which the kernel forgets at close (a
//! FIN queued behind data, a segment retransmitted after), so every
//! connection the proxy opens goes through [`connect`]: its data path's
//! and its control plane's alike (the C library's name lookups aside:
//! docs/interception.md).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};

use tether_core::marks::PROXY_OWN_MARK;
use tokio::net::{TcpSocket, TcpStream};

/// Whether this process marks the connections it opens: set once, at
/// start, in transparent mode.
static MARK_OWN_SOCKETS: AtomicBool = AtomicBool::new(false);

/// From now on, every connection this process opens through [`connect`]
/// carries [`PROXY_OWN_MARK`] (transparent mode).
pub fn mark_own_sockets() {
    MARK_OWN_SOCKETS.store(true, Ordering::Relaxed);
}

/// The mark this process's connections carry, if any.
pub fn own_mark() -> Option<u32> {
    MARK_OWN_SOCKETS
        .load(Ordering::Relaxed)
        .then_some(PROXY_OWN_MARK)
}

/// A TCP connection to `addr`, marked as this process's own once
/// [`mark_own_sockets`] has been called.
pub async fn connect(addr: SocketAddr) -> std::io::Result<TcpStream> {
    connect_marked(addr, own_mark()).await
}

async fn connect_marked(addr: SocketAddr, mark: Option<u32>) -> std::io::Result<TcpStream> {
    match mark {
        Some(mark) => {
            let socket = socket_for(addr)?;
            set_mark(&socket, mark)?;
            socket.connect(addr).await
        }
        None => TcpStream::connect(addr).await,
    }
}

/// A socket of `addr`'s family.
pub fn socket_for(addr: SocketAddr) -> std::io::Result<TcpSocket> {
    match addr {
        SocketAddr::V4(_) => TcpSocket::new_v4(),
        SocketAddr::V6(_) => TcpSocket::new_v6(),
    }
}

/// Marks `socket` (`SO_MARK`); without the capability that needs, the
/// error says which.
pub fn set_mark(socket: &TcpSocket, mark: u32) -> std::io::Result<()> {
    socket2::SockRef::from(socket)
        .set_mark(mark)
        .map_err(|e| needs_capability("SO_MARK", e))
}

/// `e`, or for a refusal, an error naming the capability `option` needs.
pub fn needs_capability(option: &str, e: std::io::Error) -> std::io::Error {
    if e.kind() != std::io::ErrorKind::PermissionDenied {
        return e;
    }
    std::io::Error::new(
        e.kind(),
        format!(
            "--transparent: {option} needs CAP_NET_RAW (CAP_NET_ADMIN before Linux 5.17) ({e})"
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_connection_carries_the_mark_or_names_the_capability() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let at = listener.local_addr().unwrap();
        match connect_marked(at, Some(PROXY_OWN_MARK)).await {
            // As root (CI): connected, and marked.
            Ok(stream) => {
                let _ = listener.accept().await.unwrap();
                assert_eq!(
                    socket2::SockRef::from(&stream).mark().unwrap(),
                    PROXY_OWN_MARK
                );
            }
            Err(e) => assert!(e.to_string().contains("SO_MARK needs CAP_NET_RAW"), "{e}"),
        }
        let plain = connect_marked(at, None).await.unwrap();
        let _ = listener.accept().await.unwrap();
        // Reading a mark needs no capability.
        assert_eq!(socket2::SockRef::from(&plain).mark().unwrap(), 0);
    }
}
