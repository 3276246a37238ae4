//! The demo app's gRPC API, `tether.demo.v1.Demo`: a unary `Hello` and a
//! server-streaming `Count`. Both answers name the replica that served them.
//! Messages are declared with prost's derive; there is no .proto build step.

use std::pin::Pin;

use futures::Stream;
use http::uri::PathAndQuery;
use tonic::transport::Channel;
use tonic::Status;
use tonic_prost::ProstCodec;

pub const HELLO: &str = "/tether.demo.v1.Demo/Hello";
pub const COUNT: &str = "/tether.demo.v1.Demo/Count";

#[derive(Clone, PartialEq, prost::Message)]
pub struct HelloRequest {
    #[prost(string, tag = "1")]
    pub name: String,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct HelloReply {
    #[prost(string, tag = "1")]
    pub message: String,
    #[prost(string, tag = "2")]
    pub replica: String,
    #[prost(uint32, tag = "3")]
    pub seq: u32,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct CountRequest {
    #[prost(uint32, tag = "1")]
    pub count: u32,
}

pub type ReplyStream = Pin<Box<dyn Stream<Item = Result<HelloReply, Status>> + Send + 'static>>;

/// A channel to `connect` whose requests name `authority` (for calls
/// through an outbound proxy).
pub async fn channel(
    connect: std::net::SocketAddr,
    authority: &str,
) -> Result<Channel, tonic::transport::Error> {
    let origin: http::Uri = format!("http://{authority}")
        .parse()
        .expect("valid authority");
    tonic::transport::Endpoint::from_shared(format!("http://{connect}"))?
        .origin(origin)
        .connect()
        .await
}

pub async fn hello(channel: Channel, name: &str) -> Result<HelloReply, Status> {
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready()
        .await
        .map_err(|e| Status::unavailable(e.to_string()))?;
    grpc.unary(
        tonic::Request::new(HelloRequest { name: name.into() }),
        PathAndQuery::from_static(HELLO),
        ProstCodec::<HelloRequest, HelloReply>::default(),
    )
    .await
    .map(|r| r.into_inner())
}

pub async fn count(channel: Channel, count: u32) -> Result<Vec<HelloReply>, Status> {
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready()
        .await
        .map_err(|e| Status::unavailable(e.to_string()))?;
    let mut stream = grpc
        .server_streaming(
            tonic::Request::new(CountRequest { count }),
            PathAndQuery::from_static(COUNT),
            ProstCodec::<CountRequest, HelloReply>::default(),
        )
        .await?
        .into_inner();
    let mut out = Vec::new();
    while let Some(reply) = stream.message().await? {
        out.push(reply);
    }
    Ok(out)
}
