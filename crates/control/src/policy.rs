//! The policy APIs, answered with defaults so that any linkerd2-proxy-api
//! client gets an answer instead of hanging: outbound policy is `NotFound`
//! (clients fall back to `Destination` discovery), inbound policy is one
//! permissive server with protocol detection.

use std::collections::HashMap;

use linkerd2_proxy_api::inbound::{
    authn, inbound_server_policies_server::InboundServerPolicies, proxy_protocol, Authn, Authz,
    Network, PortSpec, ProxyProtocol, Server,
};
use linkerd2_proxy_api::net::IpNetwork;
use linkerd2_proxy_api::outbound::{
    outbound_policies_server::OutboundPolicies, OutboundPolicy, TrafficSpec,
};
use tether_admin::Shutdown;
use tonic::{Request, Response, Status};

use crate::destination::{one_then_hold, BoxStream};

#[derive(Clone)]
pub struct PolicyService {
    pub shutdown: Shutdown,
}

/// Allows every client, plaintext or TLS, and detects the protocol.
pub fn default_server() -> Server {
    let all = |net: std::net::IpAddr| Network {
        net: Some(IpNetwork::from((net, 0u8))),
        except: vec![],
    };
    let labels = HashMap::from([
        ("kind".to_string(), "default".to_string()),
        ("name".to_string(), "all-unauthenticated".to_string()),
    ]);
    Server {
        protocol: Some(ProxyProtocol {
            kind: Some(proxy_protocol::Kind::Detect(proxy_protocol::Detect {
                timeout: Some(prost_types::Duration {
                    seconds: 10,
                    nanos: 0,
                }),
                ..Default::default()
            })),
        }),
        server_ips: vec![],
        authorizations: vec![Authz {
            networks: vec![
                all(std::net::Ipv4Addr::UNSPECIFIED.into()),
                all(std::net::Ipv6Addr::UNSPECIFIED.into()),
            ],
            authentication: Some(Authn {
                permit: Some(authn::Permit::Unauthenticated(
                    authn::PermitUnauthenticated {},
                )),
            }),
            labels: labels.clone(),
            metadata: None,
        }],
        labels,
    }
}

fn no_outbound_policy() -> Status {
    Status::not_found("tether serves no outbound policy; use Destination discovery")
}

#[tonic::async_trait]
impl OutboundPolicies for PolicyService {
    type WatchStream = BoxStream<OutboundPolicy>;

    async fn get(&self, _req: Request<TrafficSpec>) -> Result<Response<OutboundPolicy>, Status> {
        Err(no_outbound_policy())
    }

    async fn watch(
        &self,
        _req: Request<TrafficSpec>,
    ) -> Result<Response<Self::WatchStream>, Status> {
        Err(no_outbound_policy())
    }
}

#[tonic::async_trait]
impl InboundServerPolicies for PolicyService {
    type WatchPortStream = BoxStream<Server>;

    async fn get_port(&self, _req: Request<PortSpec>) -> Result<Response<Server>, Status> {
        Ok(Response::new(default_server()))
    }

    async fn watch_port(
        &self,
        _req: Request<PortSpec>,
    ) -> Result<Response<Self::WatchPortStream>, Status> {
        Ok(Response::new(one_then_hold(
            default_server(),
            self.shutdown.clone(),
        )))
    }
}
