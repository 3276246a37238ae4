//! What every Tether process shares at its edge: the admin listener
//! (`/live`, `/ready`, `/metrics`), readiness conditions, and shutdown.
//!
//! - [`Readiness`]: named conditions a process waits for before it reports
//!   ready; `/ready` names the ones still missing.
//! - [`serve`]: the admin HTTP listener (`/live`, `/ready`, `/metrics`,
//!   `/version`).
//! - [`Shutdown`]: one signal, fired by SIGTERM/SIGINT, that listeners watch
//!   so they stop accepting and drain.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use prometheus_client::registry::Registry;
use tokio::net::TcpListener;
use tokio::sync::watch;

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

/// Serves the admin endpoints on `listener` until `shutdown` fires.
pub async fn serve(listener: TcpListener, admin: Admin, shutdown: Shutdown) {
    loop {
        let (stream, _) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    tracing::warn!(error = %e, "admin accept failed");
                    continue;
                }
            },
            _ = shutdown.triggered() => return,
        };
        let admin = admin.clone();
        tokio::spawn(async move {
            let svc = hyper::service::service_fn(move |req| {
                let rsp = respond(&admin, &req);
                async move { Ok::<_, Infallible>(rsp) }
            });
            let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                .serve_connection(TokioIo::new(stream), svc)
                .await;
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
}
