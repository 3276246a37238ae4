//! Plain HTTP/1.1 GETs of admin endpoints (and a Prometheus's HTTP API),
//! bounded in time and in the size of what is read back.

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Empty, Limited};
use hyper_util::rt::TokioIo;
use tether_core::prom::{self, Sample};

/// A metrics page of a busy proxy is some hundred KiB; more is not a scrape.
pub const MAX_BODY_BYTES: usize = 16 << 20;
pub const TIMEOUT: Duration = Duration::from_secs(5);

#[derive(Debug, thiserror::Error)]
pub enum ScrapeError {
    #[error("GET http://{addr}{path}: {reason}")]
    Failed {
        addr: SocketAddr,
        path: String,
        reason: String,
    },
    #[error("GET http://{addr}{path} timed out after {TIMEOUT:?}")]
    TimedOut { addr: SocketAddr, path: String },
}

/// GETs `path_and_query` from `addr` with `host` as the Host header:
/// the status and the body (at most [`MAX_BODY_BYTES`]).
pub async fn get(
    addr: SocketAddr,
    host: &str,
    path_and_query: &str,
) -> Result<(u16, String), ScrapeError> {
    let failed = |reason: String| ScrapeError::Failed {
        addr,
        path: tether_core::truncate::for_log(path_and_query).to_string(),
        reason,
    };
    let fut = async {
        let stream = tokio::net::TcpStream::connect(addr)
            .await
            .map_err(|e| failed(e.to_string()))?;
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| failed(e.to_string()))?;
        tokio::spawn(conn);
        let req = http::Request::get(path_and_query)
            .header(http::header::HOST, host)
            .body(Empty::<Bytes>::new())
            .map_err(|e| failed(e.to_string()))?;
        let rsp = sender
            .send_request(req)
            .await
            .map_err(|e| failed(e.to_string()))?;
        let status = rsp.status().as_u16();
        let body = Limited::new(rsp.into_body(), MAX_BODY_BYTES)
            .collect()
            .await
            .map_err(|e| failed(e.to_string()))?
            .to_bytes();
        Ok((status, String::from_utf8_lossy(&body).into_owned()))
    };
    tokio::time::timeout(TIMEOUT, fut)
        .await
        .map_err(|_| ScrapeError::TimedOut {
            addr,
            path: tether_core::truncate::for_log(path_and_query).to_string(),
        })?
}

/// The samples of one admin listener's `/metrics`.
pub async fn metrics(admin: SocketAddr) -> Result<Vec<Sample>, ScrapeError> {
    match get(admin, &admin.to_string(), "/metrics").await? {
        (200, text) => Ok(prom::parse(&text)),
        (status, _) => Err(ScrapeError::Failed {
            addr: admin,
            path: "/metrics".into(),
            reason: format!("status {status}"),
        }),
    }
}

/// Scrapes every address at once; each result in the order given.
pub async fn metrics_all(admins: &[SocketAddr]) -> Vec<Result<Vec<Sample>, ScrapeError>> {
    futures::future::join_all(admins.iter().map(|a| metrics(*a))).await
}
