//! `tether gateway`: the multicluster gateway.

use std::net::SocketAddr;

use tether_admin::Shutdown;

use super::args::{BootstrapArgs, IdentityArgs};

/// Requests from a whole remote cluster may wait here for an endpoint.
const MAX_PENDING: usize = 1000;

/// Run the multicluster gateway: mTLS from other clusters to local global services.
#[derive(clap::Args)]
#[command(mut_arg("identity", |a| a.required(true)))]
pub struct GatewayArgs {
    #[command(flatten)]
    bootstrap: BootstrapArgs,
    /// Where other clusters' proxies connect (mTLS only).
    #[arg(long, default_value = "0.0.0.0:4180")]
    listen: SocketAddr,
    #[command(flatten)]
    identity: IdentityArgs,
    /// Clients must hold identities of this trust domain.
    #[arg(long, default_value = "cluster.local")]
    trust_domain: String,
}

impl GatewayArgs {
    /// Worker threads for the runtime (`--threads`, else the CPU quota, else 1).
    pub fn worker_threads(&self) -> usize {
        self.bootstrap.worker_threads()
    }

    pub fn into_config(self) -> anyhow::Result<tether_proxy::gateway::GatewayConfig> {
        let identity = self.identity.into_config()?;
        anyhow::ensure!(identity.is_some(), "the gateway needs --identity");
        let outbound = tether_proxy::outbound::OutboundConfig {
            failfast_timeout: self.bootstrap.failfast_timeout,
            max_pending: MAX_PENDING,
            response_timeout: self.bootstrap.serve.response_timeout(),
            ..Default::default()
        };
        Ok(tether_proxy::gateway::GatewayConfig {
            bootstrap: self.bootstrap.into_config(
                identity,
                tether_proxy::tls::TlsMode::Mandatory,
                Default::default(),
            ),
            listen: self.listen,
            trust_domain: self.trust_domain,
            outbound,
        })
    }

    pub async fn run(self, shutdown: Shutdown) -> anyhow::Result<()> {
        tether_proxy::gateway::run(self.into_config()?, shutdown).await?;
        Ok(())
    }
}
