//! `tether dashboard`: the live web page of the mesh.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use tether_admin::Shutdown;
use tether_viz::state;

use super::args::parse_positive_secs;

/// Serve a live web dashboard of the mesh `tether up` runs (topology, golden metrics, endpoints, failover, control plane).
#[derive(clap::Args)]
pub struct DashboardArgs {
    /// Where to serve the page (announced as `listening dashboard ADDR`).
    #[arg(long, default_value = "127.0.0.1:50750")]
    listen: SocketAddr,
    /// The mesh state file `tether up` wrote.
    #[arg(long, env = state::STATE_ENV)]
    state: Option<PathBuf>,
    /// Seconds between samples of the mesh.
    #[arg(long, default_value = "1", value_parser = parse_positive_secs)]
    interval: Duration,
    /// Points kept per chart.
    #[arg(long, default_value = "300", value_parser = clap::value_parser!(u64).range(1..=100_000))]
    history: u64,
}

impl DashboardArgs {
    pub async fn run(self, shutdown: Shutdown) -> anyhow::Result<()> {
        let config = tether_viz::dashboard::DashboardConfig {
            listen: self.listen,
            state: self.state.unwrap_or_else(state::default_path),
            interval: self.interval,
            history: super::args::count(self.history),
        };
        tether_viz::dashboard::run(config, shutdown).await?;
        Ok(())
    }
}
