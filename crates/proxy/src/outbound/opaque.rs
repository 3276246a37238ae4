//! The opaque TCP path: a connection to a port declared opaque is copied
//! byte for byte to an endpoint, trying up to three endpoints to connect.
//! To a peer proxy (discovery's `opaque_transport` hint) the connection
//! offers ALPN `transport.l5d.io/v1` over mTLS and, when the peer accepts
//! it, starts with linkerd2-proxy's transport header naming the target
//! port ([`crate::transport_header`]). Tether's control plane gives the
//! peer's inbound address as the endpoint, so the target port is the
//! endpoint's port.

use std::sync::Arc;

use tokio::io::AsyncWriteExt;

use super::{Outbound, CONNECT_ATTEMPTS};
use crate::balance::{pick, EndpointHandle};

impl Outbound {
    pub(super) async fn forward_tcp(
        &self,
        mut client: crate::tls::BoxedIo,
        authority: &str,
        endpoints: &[Arc<EndpointHandle>],
    ) {
        let mut tried = Vec::new();
        while let Some(ep) = pick(endpoints, &tried) {
            let addr = ep.endpoint.addr;
            let _in_flight = ep.start();
            let connected = if ep.endpoint.meshed {
                ep.client.connect_opaque().await
            } else {
                ep.client
                    .connect_stream()
                    .await
                    .map(|(io, tls)| crate::tls::Connected {
                        io,
                        tls,
                        transport_header: false,
                    })
            };
            let mut server = match connected {
                Ok(c) if c.transport_header => {
                    let mut io = c.io;
                    let header = crate::transport_header::encode(addr.port());
                    if io.write_all(&header).await.is_err() {
                        return;
                    }
                    io
                }
                Ok(c) => c.io,
                Err(reason) => {
                    tracing::debug!(%authority, %addr, %reason, "opaque connect failed");
                    ep.mark_failed();
                    tried.push(addr);
                    if tried.len() >= CONNECT_ATTEMPTS {
                        break;
                    }
                    continue;
                }
            };
            let copied = tokio::io::copy_bidirectional(&mut client, &mut server).await;
            if let Ok((up, down)) = copied {
                self.metrics
                    .tcp_bytes
                    .get_or_create(&crate::metrics::DirectionLabels {
                        direction: "outbound".into(),
                    })
                    .inc_by(up + down);
            }
            return;
        }
        tracing::warn!(%authority, "no endpoint reachable for opaque connection");
    }
}
