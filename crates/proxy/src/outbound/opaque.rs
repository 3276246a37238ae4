//! The opaque TCP path: a connection to a port declared opaque is copied
//! byte for byte to an endpoint (after Tether's opaque preface when the
//! endpoint is a peer proxy), trying up to three endpoints to connect.

use std::sync::Arc;

use tokio::io::AsyncWriteExt;

use super::{Outbound, CONNECT_ATTEMPTS};
use crate::balance::{pick, EndpointHandle};
use crate::detect::OPAQUE_PREFACE;

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
            let mut server = match ep.client.connect_stream().await {
                Ok((s, _tls)) => s,
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
            if ep.endpoint.meshed && server.write_all(OPAQUE_PREFACE).await.is_err() {
                return;
            }
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
