//! The demo workload: answers HTTP/1.1, HTTP/2 and gRPC, names the replica
//! that answered, and has a latency and an error rate that can be set at
//! start or changed at runtime (`POST /admin/config?latency_ms=5&error_rate=0.1`).

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures::future::BoxFuture;
use http::{Request, Response, StatusCode};
use http_body_util::{combinators::UnsyncBoxBody, BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use rand::Rng;
use tether_admin::Shutdown;
use tokio::net::TcpListener;
use tonic::Status;
use tonic_prost::ProstCodec;

use crate::demo_grpc::{CountRequest, HelloReply, HelloRequest, ReplyStream, COUNT, HELLO};

/// The response header naming the replica.
pub const REPLICA_HEADER: &str = "tether-demo-replica";

pub struct DemoConfig {
    pub service: String,
    pub replica: String,
    pub latency: Duration,
    pub error_rate: f64,
}

impl DemoConfig {
    /// A demo app answering with `latency_ms` of added latency and failing
    /// `error_rate` (0 to 1) of requests.
    pub fn new(
        service: String,
        replica: String,
        latency_ms: f64,
        error_rate: f64,
    ) -> Result<Self, DemoConfigError> {
        let latency = (latency_ms >= 0.0)
            .then(|| Duration::try_from_secs_f64(latency_ms / 1000.0).ok())
            .flatten()
            .ok_or(DemoConfigError::Latency)?;
        if !(0.0..=1.0).contains(&error_rate) {
            return Err(DemoConfigError::ErrorRate);
        }
        Ok(Self {
            service,
            replica,
            latency,
            error_rate,
        })
    }
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum DemoConfigError {
    #[error("--latency-ms must be at least 0")]
    Latency,
    #[error("--error-rate must be between 0 and 1")]
    ErrorRate,
}

struct State {
    service: String,
    replica: String,
    latency_us: AtomicU64,
    error_rate_bits: AtomicU64,
}

impl State {
    fn latency(&self) -> Duration {
        Duration::from_micros(self.latency_us.load(Ordering::Relaxed))
    }
    fn error_rate(&self) -> f64 {
        f64::from_bits(self.error_rate_bits.load(Ordering::Relaxed))
    }
    /// Waits the configured latency; says whether to fail this request.
    async fn behave(&self) -> bool {
        let latency = self.latency();
        if !latency.is_zero() {
            tokio::time::sleep(latency).await;
        }
        rand::rng().random_bool(self.error_rate().clamp(0.0, 1.0))
    }
}

type Body = UnsyncBoxBody<Bytes, Box<dyn std::error::Error + Send + Sync>>;

fn text(status: StatusCode, body: String, state: &State) -> Response<Body> {
    Response::builder()
        .status(status)
        .header(http::header::CONTENT_TYPE, "application/json")
        .header(REPLICA_HEADER, state.replica.as_str())
        .body(
            Full::new(Bytes::from(body))
                .map_err(|e| match e {})
                .boxed_unsync(),
        )
        .unwrap()
}

pub async fn run(
    listen: SocketAddr,
    config: DemoConfig,
    shutdown: Shutdown,
) -> std::io::Result<()> {
    let listener = TcpListener::bind(listen).await?;
    tether_admin::announce("http", listener.local_addr()?);
    let state = Arc::new(State {
        service: config.service,
        replica: config.replica,
        latency_us: AtomicU64::new(config.latency.as_micros() as u64),
        error_rate_bits: AtomicU64::new(config.error_rate.to_bits()),
    });
    loop {
        let (stream, _) = tokio::select! {
            a = listener.accept() => a?,
            _ = shutdown.triggered() => return Ok(()),
        };
        let _ = stream.set_nodelay(true);
        let state = state.clone();
        tokio::spawn(async move {
            let svc = hyper::service::service_fn(move |req| {
                let state = state.clone();
                async move { Ok::<_, Infallible>(handle(state, req).await) }
            });
            let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                .serve_connection(TokioIo::new(stream), svc)
                .await;
        });
    }
}

async fn handle(state: Arc<State>, req: Request<Incoming>) -> Response<Body> {
    let is_grpc = req
        .headers()
        .get(http::header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"application/grpc"));
    if is_grpc {
        return grpc(state, req).await;
    }
    let path = req.uri().path().to_string();
    if path == "/admin/config" {
        return configure(&state, req.uri().query().unwrap_or(""));
    }
    let method = req.method().to_string();
    let version = format!("{:?}", req.version());
    let client_id = req
        .headers()
        .get("tether-client-id")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let received = req
        .into_body()
        .collect()
        .await
        .map(|b| b.to_bytes().len())
        .unwrap_or(0);
    if state.behave().await {
        return text(
            StatusCode::INTERNAL_SERVER_ERROR,
            "{\"error\":\"injected error\"}\n".into(),
            &state,
        );
    }
    let body = serde_json::json!({
        "service": state.service,
        "replica": state.replica,
        "method": method,
        "path": path,
        "version": version,
        "received_bytes": received,
        "client_id": client_id,
    });
    text(StatusCode::OK, format!("{body}\n"), &state)
}

fn configure(state: &State, query: &str) -> Response<Body> {
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
        let ok = match key {
            "latency_ms" => value.parse::<f64>().ok().filter(|v| *v >= 0.0).map(|v| {
                state
                    .latency_us
                    .store((v * 1000.0) as u64, Ordering::Relaxed);
            }),
            "error_rate" => value
                .parse::<f64>()
                .ok()
                .filter(|v| (0.0..=1.0).contains(v))
                .map(|v| {
                    state.error_rate_bits.store(v.to_bits(), Ordering::Relaxed);
                }),
            _ => None,
        };
        if ok.is_none() {
            return text(
                StatusCode::BAD_REQUEST,
                format!("{{\"error\":\"invalid setting {pair:?}: expected latency_ms>=0 or error_rate in 0..1\"}}\n"),
                state,
            );
        }
    }
    let body = serde_json::json!({
        "latency_ms": state.latency().as_secs_f64() * 1000.0,
        "error_rate": state.error_rate(),
    });
    text(StatusCode::OK, format!("{body}\n"), state)
}

// === gRPC ===

#[derive(Clone)]
struct Hello(Arc<State>);

impl tonic::server::UnaryService<HelloRequest> for Hello {
    type Response = HelloReply;
    type Future = BoxFuture<'static, Result<tonic::Response<HelloReply>, Status>>;

    fn call(&mut self, req: tonic::Request<HelloRequest>) -> Self::Future {
        let state = self.0.clone();
        Box::pin(async move {
            if state.behave().await {
                return Err(Status::internal("injected error"));
            }
            Ok(tonic::Response::new(HelloReply {
                message: format!("hello, {}", req.into_inner().name),
                replica: state.replica.clone(),
                seq: 0,
            }))
        })
    }
}

#[derive(Clone)]
struct Count(Arc<State>);

impl tonic::server::ServerStreamingService<CountRequest> for Count {
    type Response = HelloReply;
    type ResponseStream = ReplyStream;
    type Future = BoxFuture<'static, Result<tonic::Response<ReplyStream>, Status>>;

    fn call(&mut self, req: tonic::Request<CountRequest>) -> Self::Future {
        let state = self.0.clone();
        Box::pin(async move {
            if state.behave().await {
                return Err(Status::internal("injected error"));
            }
            let n = req.into_inner().count.min(10_000);
            let replica = state.replica.clone();
            let stream = futures::stream::iter((1..=n).map(move |seq| {
                Ok(HelloReply {
                    message: format!("{seq} of {n}"),
                    replica: replica.clone(),
                    seq,
                })
            }));
            Ok(tonic::Response::new(Box::pin(stream) as ReplyStream))
        })
    }
}

async fn grpc(state: Arc<State>, req: Request<Incoming>) -> Response<Body> {
    let rsp = match req.uri().path() {
        HELLO => {
            let mut server =
                tonic::server::Grpc::new(ProstCodec::<HelloReply, HelloRequest>::default());
            server.unary(Hello(state.clone()), req).await
        }
        COUNT => {
            let mut server =
                tonic::server::Grpc::new(ProstCodec::<HelloReply, CountRequest>::default());
            server.server_streaming(Count(state.clone()), req).await
        }
        other => Status::unimplemented(format!("no method {other}")).into_http(),
    };
    let (mut parts, body) = rsp.into_parts();
    if let Ok(v) = http::HeaderValue::from_str(&state.replica) {
        parts.headers.insert(REPLICA_HEADER, v);
    }
    Response::from_parts(parts, body.map_err(|e| Box::new(e) as _).boxed_unsync())
}

#[cfg(test)]
mod config_tests {
    use super::*;

    #[test]
    fn latency_and_error_rate_are_checked() {
        let new = |latency_ms, error_rate| {
            DemoConfig::new("web".into(), "web-0".into(), latency_ms, error_rate)
        };
        let ok = new(2.5, 1.0).unwrap();
        assert_eq!(ok.latency, Duration::from_micros(2500));
        for latency in [-1.0, f64::NAN, f64::INFINITY] {
            assert_eq!(new(latency, 0.0).err(), Some(DemoConfigError::Latency));
        }
        for rate in [-0.1, 1.5, f64::NAN] {
            assert_eq!(new(0.0, rate).err(), Some(DemoConfigError::ErrorRate));
        }
    }
}
