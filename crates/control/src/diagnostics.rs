//! `tether.diagnostics.v1.Diagnostics`: Tether's own gRPC API for operator
//! tools, served on the control plane's gRPC port next to the proxy API.
//! Version 1 has one method, `Metrics`, which returns the replica's
//! Prometheus metrics as text, so `tether diagnostics controller-metrics`
//! needs only the addresses proxies already use. Documented in
//! `docs/diagnostics-api.md`. Messages are declared with prost's derive.

use std::convert::Infallible;
use std::sync::Arc;
use std::task::{Context, Poll};

use futures::future::BoxFuture;
use http::uri::PathAndQuery;
use tonic::{Request, Response, Status};
use tonic_prost::ProstCodec;

pub const SERVICE: &str = "tether.diagnostics.v1.Diagnostics";
pub const METRICS: &str = "/tether.diagnostics.v1.Diagnostics/Metrics";

#[derive(Clone, PartialEq, prost::Message)]
pub struct MetricsRequest {}

#[derive(Clone, PartialEq, prost::Message)]
pub struct MetricsResponse {
    /// Prometheus text exposition of the replica's metrics.
    #[prost(string, tag = "1")]
    pub text: String,
    /// The replica's Tether version.
    #[prost(string, tag = "2")]
    pub version: String,
}

#[derive(Clone)]
pub struct DiagnosticsServer {
    metrics: Arc<prometheus_client::registry::Registry>,
}

impl DiagnosticsServer {
    pub fn new(metrics: Arc<prometheus_client::registry::Registry>) -> Self {
        Self { metrics }
    }
}

impl tonic::server::NamedService for DiagnosticsServer {
    const NAME: &'static str = SERVICE;
}

#[derive(Clone)]
struct MetricsMethod(Arc<prometheus_client::registry::Registry>);

impl tonic::server::UnaryService<MetricsRequest> for MetricsMethod {
    type Response = MetricsResponse;
    type Future = BoxFuture<'static, Result<Response<MetricsResponse>, Status>>;

    fn call(&mut self, _req: Request<MetricsRequest>) -> Self::Future {
        let registry = self.0.clone();
        Box::pin(async move {
            let mut text = String::new();
            prometheus_client::encoding::text::encode(&mut text, &registry)
                .map_err(|e| Status::internal(format!("encoding metrics: {e}")))?;
            Ok(Response::new(MetricsResponse {
                text,
                version: env!("CARGO_PKG_VERSION").to_string(),
            }))
        })
    }
}

impl tower_service::Service<http::Request<tonic::body::Body>> for DiagnosticsServer {
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = BoxFuture<'static, Result<Self::Response, Infallible>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<tonic::body::Body>) -> Self::Future {
        let registry = self.metrics.clone();
        Box::pin(async move {
            Ok(match req.uri().path() {
                METRICS => {
                    let mut grpc = tonic::server::Grpc::new(ProstCodec::<
                        MetricsResponse,
                        MetricsRequest,
                    >::default());
                    grpc.unary(MetricsMethod(registry), req).await
                }
                other => Status::unimplemented(format!("no method {other}")).into_http(),
            })
        })
    }
}

/// Fetches a replica's metrics.
pub async fn fetch_metrics(channel: tonic::transport::Channel) -> Result<MetricsResponse, Status> {
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready()
        .await
        .map_err(|e| Status::unavailable(e.to_string()))?;
    grpc.unary(
        Request::new(MetricsRequest {}),
        PathAndQuery::from_static(METRICS),
        ProstCodec::<MetricsRequest, MetricsResponse>::default(),
    )
    .await
    .map(|r| r.into_inner())
}
