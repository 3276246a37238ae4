//! `tether.multicluster.v1.Export`: what this cluster offers to others.
//! Documented in `docs/export-api.md`. `Watch` streams the whole export —
//! ready endpoints per global id, the gateway's address and identity —
//! every [`HEARTBEAT`]; a receiver that hears nothing for about a second
//! treats the cluster as unreachable.

use std::convert::Infallible;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use futures::future::BoxFuture;
use futures::Stream;
use http::uri::PathAndQuery;
use tether_admin::Shutdown;
use tonic::{Request, Response, Status};
use tonic_prost::ProstCodec;

use crate::index::Index;

pub const SERVICE: &str = "tether.multicluster.v1.Export";
pub const WATCH: &str = "/tether.multicluster.v1.Export/Watch";
pub const HEARTBEAT: Duration = Duration::from_millis(250);

#[derive(Clone, PartialEq, prost::Message)]
pub struct WatchRequest {
    /// The asking cluster's name, for logs.
    #[prost(string, tag = "1")]
    pub cluster: String,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct ExportedService {
    #[prost(string, tag = "1")]
    pub global_id: String,
    #[prost(uint32, tag = "2")]
    pub ready_endpoints: u32,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct ExportState {
    #[prost(string, tag = "1")]
    pub cluster: String,
    #[prost(string, tag = "2")]
    pub gateway_address: String,
    #[prost(string, tag = "3")]
    pub gateway_identity: String,
    #[prost(message, repeated, tag = "4")]
    pub services: Vec<ExportedService>,
}

/// What this cluster advertises.
#[derive(Clone)]
pub struct ExportConfig {
    pub cluster: String,
    pub gateway_address: String,
    pub gateway_identity: String,
}

#[derive(Clone)]
pub struct ExportServer {
    index: Index,
    config: ExportConfig,
    shutdown: Shutdown,
}

impl ExportServer {
    pub fn new(index: Index, config: ExportConfig, shutdown: Shutdown) -> Self {
        Self {
            index,
            config,
            shutdown,
        }
    }
}

impl tonic::server::NamedService for ExportServer {
    const NAME: &'static str = SERVICE;
}

type StateStream = Pin<Box<dyn Stream<Item = Result<ExportState, Status>> + Send>>;

#[derive(Clone)]
struct WatchMethod(ExportServer);

impl tonic::server::ServerStreamingService<WatchRequest> for WatchMethod {
    type Response = ExportState;
    type ResponseStream = StateStream;
    type Future = BoxFuture<'static, Result<Response<StateStream>, Status>>;

    fn call(&mut self, req: Request<WatchRequest>) -> Self::Future {
        let server = self.0.clone();
        Box::pin(async move {
            tracing::info!(peer = %req.into_inner().cluster, "export watched");
            let (tx, rx) = tokio::sync::mpsc::channel(2);
            tokio::spawn(async move {
                let mut tick = tokio::time::interval(HEARTBEAT);
                loop {
                    tokio::select! {
                        _ = tick.tick() => {}
                        _ = server.shutdown.triggered() => return,
                        _ = tx.closed() => return,
                    }
                    let state = ExportState {
                        cluster: server.config.cluster.clone(),
                        gateway_address: server.config.gateway_address.clone(),
                        gateway_identity: server.config.gateway_identity.clone(),
                        services: server
                            .index
                            .exported()
                            .into_iter()
                            .map(|(global_id, ready_endpoints)| ExportedService {
                                global_id,
                                ready_endpoints,
                            })
                            .collect(),
                    };
                    // A full channel means a slow watcher: skip this beat.
                    if let Err(tokio::sync::mpsc::error::TrySendError::Closed(_)) =
                        tx.try_send(Ok(state))
                    {
                        return;
                    }
                }
            });
            Ok(Response::new(
                Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx)) as StateStream,
            ))
        })
    }
}

impl tower_service::Service<http::Request<tonic::body::Body>> for ExportServer {
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = BoxFuture<'static, Result<Self::Response, Infallible>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<tonic::body::Body>) -> Self::Future {
        let this = self.clone();
        Box::pin(async move {
            Ok(match req.uri().path() {
                WATCH => {
                    let mut grpc = tonic::server::Grpc::new(
                        ProstCodec::<ExportState, WatchRequest>::default(),
                    );
                    grpc.server_streaming(WatchMethod(this), req).await
                }
                other => Status::unimplemented(format!("no method {other}")).into_http(),
            })
        })
    }
}

/// Opens a Watch stream on a remote cluster.
pub async fn watch(
    channel: tonic::transport::Channel,
    cluster: &str,
) -> Result<tonic::codec::Streaming<ExportState>, Status> {
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready()
        .await
        .map_err(|e| Status::unavailable(e.to_string()))?;
    grpc.server_streaming(
        Request::new(WatchRequest {
            cluster: cluster.to_string(),
        }),
        PathAndQuery::from_static(WATCH),
        ProstCodec::<WatchRequest, ExportState>::default(),
    )
    .await
    .map(|r| r.into_inner())
}
