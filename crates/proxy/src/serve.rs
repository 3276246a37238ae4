//! Accept loops with graceful shutdown: on shutdown a listener stops
//! accepting, asks its HTTP connections to finish (HTTP/2 GOAWAY, HTTP/1
//! close after the current response), and waits for in-flight work up to
//! the drain timeout.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::time::Duration;

use http::{Request, Response};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::graceful::{GracefulShutdown, Watcher};
use tether_admin::Shutdown;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, TcpStream};

use crate::http::Body;

pub async fn accept_loop<H, F>(
    name: &'static str,
    listener: TcpListener,
    shutdown: Shutdown,
    drain: Duration,
    handler: H,
) where
    H: Fn(TcpStream, SocketAddr, Watcher) -> F,
    F: Future<Output = ()> + Send + 'static,
{
    let graceful = GracefulShutdown::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, peer)) => {
                    let _ = stream.set_nodelay(true);
                    tokio::spawn(handler(stream, peer, graceful.watcher()));
                }
                Err(e) => {
                    // Typically out of file descriptors: back off, keep serving.
                    tracing::warn!(listener = name, error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            },
            _ = shutdown.triggered() => break,
        }
    }
    drop(listener);
    tracing::info!(listener = name, connections = graceful.count(), "draining");
    tokio::select! {
        _ = graceful.shutdown() => {}
        _ = tokio::time::sleep(drain) => {
            tracing::warn!(listener = name, "drain timeout passed; closing remaining connections");
        }
    }
}

/// Serves HTTP/1 or HTTP/2 (detected from the preface) on one connection.
pub async fn serve_http<I, S, Fut>(io: I, service: S, watcher: Watcher)
where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    S: Fn(Request<Incoming>) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = Response<Body>> + Send + 'static,
{
    let svc = hyper::service::service_fn(move |req| {
        let fut = service(req);
        async move { Ok::<_, Infallible>(fut.await) }
    });
    let mut builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
    builder.http1().timer(hyper_util::rt::TokioTimer::new());
    let conn = builder.serve_connection(TokioIo::new(io), svc).into_owned();
    if let Err(e) = watcher.watch(conn).await {
        tracing::debug!(error = %e, "HTTP connection ended with an error");
    }
}
