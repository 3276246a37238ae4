//! A connection told to close (idle, drain) with real sockets: clients
//! that do not play along must not keep it open.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

use super::{serve_http, Conn, ServeConfig, ServeLimits};
use crate::metrics::ProxyMetrics;

/// Bounds every wait: far past the configured timeouts below on a
/// loaded machine, reached only when the awaited event never comes.
const WAIT: Duration = Duration::from_secs(20);

async fn empty_answer<B>(_req: http::Request<B>) -> http::Response<crate::http::Body> {
    http::Response::new(crate::http::empty())
}

/// An HTTP/2 client that sends its preface and SETTINGS, then answers
/// nothing (no SETTINGS ack, no PING ack) and sends no request: once idle,
/// the server's graceful GOAWAY waits for a PING round trip that never
/// ends. The connection (and its place under the connection cap) is
/// released within the drain timeout all the same.
#[tokio::test]
async fn an_idle_http2_client_that_ignores_the_goaway_is_closed() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let config = ServeConfig {
        max_connections: Some(4),
        idle_timeout: Duration::from_millis(100),
        ..ServeConfig::default()
    };
    let limits = ServeLimits::new(&config, Duration::from_millis(500), ProxyMetrics::default());
    let (_drain_tx, drain) = watch::channel(false);
    // Served in this task (a spawned serve_http trips rustc's
    // higher-ranked inference).
    let server = async move {
        let (stream, _) = listener.accept().await.unwrap();
        let conn = Conn {
            drain,
            _permit: limits.connections.clone().try_acquire_owned().unwrap(),
            limits,
            direction: "test",
        };
        serve_http(stream, empty_answer, conn).await;
    };
    let client = async {
        let mut client = TcpStream::connect(addr).await.unwrap();
        // The preface, then an empty SETTINGS frame.
        let mut hello = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
        hello.extend([0, 0, 0, 0x4, 0, 0, 0, 0, 0]);
        client.write_all(&hello).await.unwrap();
        // What the server sends is read (so it is never stuck writing)
        // and ignored, until it closes.
        let mut buf = [0u8; 4096];
        while let Ok(1..) = client.read(&mut buf).await {}
    };
    let closed = tokio::time::timeout(WAIT, async { tokio::join!(server, client) }).await;
    assert!(closed.is_ok(), "the server still holds the connection");
}
