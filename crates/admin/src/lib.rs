//! What every Tether process shares at its edge: the admin listener
//! (`/live`, `/ready`, `/metrics`), readiness conditions, and shutdown.
//!
//! - [`Readiness`]: named conditions a process waits for before it reports
//!   ready; `/ready` names the ones still missing.
//! - [`serve`]: the admin HTTP listener (`/live`, `/ready`, `/metrics`,
//!   `/version`).
//! - [`Shutdown`]: one signal, fired by SIGTERM/SIGINT, that listeners watch
//!   so they stop accepting and drain.
//! - [`threads`]: how many runtime workers a data-path process runs.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use prometheus_client::registry::Registry;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

pub mod threads;

/// Prints the line by which scripts and `tether up` learn a listener's
/// address (ports are often chosen by the OS). Printed to stdout, not logged.
pub fn announce(name: &str, addr: SocketAddr) {
    println!("listening {name} {addr}");
}

#[derive(Debug, thiserror::Error)]
#[error("binding {what} listener on {addr}: {source}")]
pub struct BindError {
    pub what: &'static str,
    pub addr: SocketAddr,
    #[source]
    pub source: std::io::Error,
}

/// Binds a listener and announces its address.
pub async fn bind(what: &'static str, addr: SocketAddr) -> Result<TcpListener, BindError> {
    let l = TcpListener::bind(addr)
        .await
        .map_err(|source| BindError { what, addr, source })?;
    announce(what, l.local_addr().unwrap_or(addr));
    Ok(l)
}

// === impl Readiness ===

/// A set of named conditions; the process is ready when all are met.
#[derive(Clone, Default)]
pub struct Readiness {
    conditions: Arc<Mutex<BTreeMap<String, bool>>>,
}

impl Readiness {
    /// Registers a condition that is not met yet.
    pub fn require(&self, condition: impl Into<String>) {
        self.conditions
            .lock()
            .unwrap()
            .insert(condition.into(), false);
    }

    pub fn set(&self, condition: &str, met: bool) {
        if let Some(c) = self.conditions.lock().unwrap().get_mut(condition) {
            *c = met;
        }
    }

    /// The conditions not met yet; empty when ready.
    pub fn missing(&self) -> Vec<String> {
        self.conditions
            .lock()
            .unwrap()
            .iter()
            .filter(|(_, met)| !**met)
            .map(|(c, _)| c.clone())
            .collect()
    }

    pub fn is_ready(&self) -> bool {
        self.missing().is_empty()
    }
}

// === impl Shutdown ===

/// A one-shot shutdown signal that any number of tasks can wait on.
#[derive(Clone)]
pub struct Shutdown {
    tx: Arc<watch::Sender<bool>>,
    rx: watch::Receiver<bool>,
}

impl Default for Shutdown {
    fn default() -> Self {
        let (tx, rx) = watch::channel(false);
        Self {
            tx: Arc::new(tx),
            rx,
        }
    }
}

impl Shutdown {
    pub fn trigger(&self) {
        self.tx.send_replace(true);
    }

    pub fn is_triggered(&self) -> bool {
        *self.rx.borrow()
    }

    /// Resolves once the signal has fired.
    pub async fn triggered(&self) {
        let mut rx = self.rx.clone();
        let _ = rx.wait_for(|fired| *fired).await;
    }

    /// Fires the signal on SIGTERM or SIGINT (Ctrl-C).
    pub fn on_signals(&self) {
        let this = self.clone();
        tokio::spawn(async move {
            let mut term =
                tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
                    .expect("SIGTERM handler");
            tokio::select! {
                _ = term.recv() => tracing::info!("SIGTERM received, shutting down"),
                _ = tokio::signal::ctrl_c() => tracing::info!("SIGINT received, shutting down"),
            }
            this.trigger();
        });
    }
}

// === accepting connections ===

/// Accept errors are logged at most this often: out of fds, a listener
/// would otherwise log every few milliseconds.
static ACCEPT_LOG: tether_core::log_limit::LogLimit =
    tether_core::log_limit::LogLimit::new(Duration::from_secs(5));

/// The next connection on `listener`. On errors (typically out of file
/// descriptors) it backs off exponentially, 5 ms to 1 s, and logs at a
/// bounded rate; it never returns an error and never spins.
pub async fn accept(listener: &TcpListener, name: &'static str) -> (TcpStream, SocketAddr) {
    let mut backoff = Duration::from_millis(5);
    loop {
        match listener.accept().await {
            Ok((stream, addr)) => {
                // Every listener here speaks request and response (HTTP,
                // gRPC): with Nagle's algorithm, a small write after one
                // not yet acknowledged waits for the peer's delayed
                // acknowledgement, up to 40 ms.
                let _ = stream.set_nodelay(true);
                return (stream, addr);
            }
            Err(e) => {
                if let Some(suppressed) = ACCEPT_LOG.allow() {
                    tracing::warn!(listener = name, error = %e, suppressed, "accept failed; backing off");
                }
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(1));
            }
        }
    }
}

/// The connections of an HTTP/2-only listener (gRPC) as a stream, each
/// yielded once it has sent the whole HTTP/2 connection preface within
/// `deadline`: a client that sends nothing, or trickles it, is closed
/// instead of holding a connection forever (the HTTP/2 server itself has no
/// handshake timeout). Accepting never waits for a slow client.
pub fn incoming_h2(
    listener: TcpListener,
    name: &'static str,
    deadline: Duration,
) -> impl futures::Stream<Item = std::io::Result<TcpStream>> + Send + 'static {
    const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
    let (tx, rx) = tokio::sync::mpsc::channel(64);
    tokio::spawn(async move {
        loop {
            let (stream, _) = tokio::select! {
                accepted = accept(&listener, name) => accepted,
                _ = tx.closed() => return,
            };
            let tx = tx.clone();
            tokio::spawn(async move {
                let mut buf = [0u8; 24];
                let preface = async {
                    loop {
                        let n = stream.peek(&mut buf).await?;
                        if n == 0 || buf[..n] != PREFACE[..n] {
                            return Ok(false);
                        }
                        if n == PREFACE.len() {
                            return Ok(true);
                        }
                        // Part of it so far: wait for more without spinning.
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                };
                if let Ok(Ok::<_, std::io::Error>(true)) =
                    tokio::time::timeout(deadline, preface).await
                {
                    let _ = tx.send(Ok(stream)).await;
                }
            });
        }
    });
    futures::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|s| (s, rx)) })
}

/// Raises the soft limit on open files to the hard limit and returns it:
/// the process then sheds load at its own connection cap rather than at
/// EMFILE.
pub fn raise_fd_limit() -> usize {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit only read and write the struct passed.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) != 0 {
            return 1024;
        }
        if limit.rlim_cur < limit.rlim_max {
            let raised = libc::rlimit {
                rlim_cur: limit.rlim_max,
                rlim_max: limit.rlim_max,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &raised) == 0 {
                limit.rlim_cur = limit.rlim_max;
            }
        }
    }
    usize::try_from(limit.rlim_cur).unwrap_or(usize::MAX)
}

// === admin listener ===

/// An extra admin route: given the path and query, answers or declines.
pub type Extra =
    Arc<dyn Fn(&Method, &str, Option<&str>) -> Option<(StatusCode, String)> + Send + Sync>;

#[derive(Clone)]
pub struct Admin {
    pub readiness: Readiness,
    pub metrics: Arc<Registry>,
    pub extra: Option<Extra>,
}

/// Admin connections open at once; more are closed at accept.
pub const ADMIN_MAX_CONNECTIONS: usize = 32;
const ADMIN_HEADER_TIMEOUT: Duration = Duration::from_secs(5);
const ADMIN_CONNECTION_LIFETIME: Duration = Duration::from_secs(60);

/// Serves the admin endpoints on `listener` until `shutdown` fires.
pub async fn serve(listener: TcpListener, admin: Admin, shutdown: Shutdown) {
    // Probes and scrapes need few connections; a flood of them must not
    // take the fds the data path and the probes themselves need.
    let connections = Arc::new(tokio::sync::Semaphore::new(ADMIN_MAX_CONNECTIONS));
    loop {
        let (stream, _) = tokio::select! {
            accepted = accept(&listener, "admin") => accepted,
            _ = shutdown.triggered() => return,
        };
        let Ok(permit) = connections.clone().try_acquire_owned() else {
            continue;
        };
        let admin = admin.clone();
        tokio::spawn(async move {
            let _permit = permit;
            let svc = hyper::service::service_fn(move |req| {
                let rsp = respond(&admin, &req);
                async move { Ok::<_, Infallible>(rsp) }
            });
            let mut builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
            builder
                .http1()
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(ADMIN_HEADER_TIMEOUT);
            let conn = builder.serve_connection(TokioIo::new(stream), svc);
            // An admin connection is short: scrapes and probes, not tunnels.
            let _ = tokio::time::timeout(ADMIN_CONNECTION_LIFETIME, conn).await;
        });
    }
}

fn text(status: StatusCode, body: String) -> Response<Full<Bytes>> {
    Response::builder()
        .status(status)
        .header(http::header::CONTENT_TYPE, "text/plain; charset=utf-8")
        .body(Full::new(Bytes::from(body)))
        .unwrap()
}

fn respond(admin: &Admin, req: &Request<Incoming>) -> Response<Full<Bytes>> {
    let path = req.uri().path();
    if let Some(extra) = &admin.extra {
        if let Some((status, body)) = extra(req.method(), path, req.uri().query()) {
            return text(status, body);
        }
    }
    match path {
        "/live" => text(StatusCode::OK, "live\n".into()),
        "/version" => text(
            StatusCode::OK,
            format!("tether {}\n", env!("CARGO_PKG_VERSION")),
        ),
        "/ready" => {
            let missing = admin.readiness.missing();
            if missing.is_empty() {
                text(StatusCode::OK, "ready\n".into())
            } else {
                text(
                    StatusCode::SERVICE_UNAVAILABLE,
                    format!("not ready: waiting for {}\n", missing.join(", ")),
                )
            }
        }
        "/metrics" => {
            let mut body = String::new();
            if let Err(e) = prometheus_client::encoding::text::encode(&mut body, &admin.metrics) {
                return text(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    format!("encoding metrics: {e}\n"),
                );
            }
            let mut rsp = text(StatusCode::OK, body);
            rsp.headers_mut().insert(
                http::header::CONTENT_TYPE,
                http::HeaderValue::from_static(
                    "application/openmetrics-text; version=1.0.0; charset=utf-8",
                ),
            );
            rsp
        }
        _ => text(
            StatusCode::NOT_FOUND,
            format!("no admin endpoint at {path}\n"),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn readiness_names_what_is_missing() {
        let r = Readiness::default();
        assert!(r.is_ready());
        r.require("registry loaded");
        r.require("certificate");
        assert_eq!(r.missing(), vec!["certificate", "registry loaded"]);
        r.set("certificate", true);
        assert_eq!(r.missing(), vec!["registry loaded"]);
        r.set("registry loaded", true);
        assert!(r.is_ready());
    }

    /// Every accepted connection sends small writes at once: with Nagle's
    /// algorithm the control plane's answer to a proxy's Certify, and its
    /// discovery updates, could wait up to 40 ms for the peer's delayed
    /// acknowledgement (a proxy's start-up took 12 ms or 50 ms by luck).
    #[tokio::test]
    async fn accepted_connections_do_not_wait_for_acknowledgements() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let _client = TcpStream::connect(addr).await.unwrap();
        let (accepted, _) = accept(&listener, "test").await;
        assert!(accepted.nodelay().unwrap());
    }

    #[tokio::test]
    async fn only_clients_that_send_the_http2_preface_are_served() {
        use futures::StreamExt;
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let incoming = incoming_h2(listener, "test", Duration::from_millis(300));
        tokio::pin!(incoming);
        let mut silent = TcpStream::connect(addr).await.unwrap();
        let mut trickle = TcpStream::connect(addr).await.unwrap();
        trickle.write_all(b"PRI * HT").await.unwrap();
        let mut garbage = TcpStream::connect(addr).await.unwrap();
        garbage.write_all(b"GET / HTTP/1.1\r\n\r\n").await.unwrap();
        let mut good = TcpStream::connect(addr).await.unwrap();
        good.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
            .await
            .unwrap();
        let served = tokio::time::timeout(Duration::from_secs(5), incoming.next())
            .await
            .expect("the client with a preface is served")
            .unwrap()
            .unwrap();
        assert_eq!(served.peer_addr().unwrap(), good.local_addr().unwrap());
        // The others are closed, the silent and the slow ones at the deadline.
        for (what, conn) in [
            ("silent", &mut silent),
            ("trickle", &mut trickle),
            ("garbage", &mut garbage),
        ] {
            let mut buf = [0u8; 8];
            let read = tokio::time::timeout(Duration::from_secs(5), conn.read(&mut buf)).await;
            assert!(matches!(read, Ok(Ok(0)) | Ok(Err(_))), "{what} still open");
        }
    }
}
