//! `tether demo-app` and `tether load`: the demo workload and the load
//! generator `tether up` runs, usable on their own.

use std::net::SocketAddr;
use std::time::Duration;

use tether_admin::Shutdown;
use tether_mesh_up::demo_app::DemoConfig;
use tether_mesh_up::loadgen::{LoadProtocol, LoadSpec};

use super::args::parse_secs;

/// Run the demo app (HTTP/1.1, HTTP/2 and gRPC).
#[derive(clap::Args)]
pub struct DemoAppArgs {
    /// Listen address.
    #[arg(long, default_value = "127.0.0.1:8080")]
    listen: SocketAddr,
    /// The service name reported in every answer.
    #[arg(long, default_value = "demo")]
    service: String,
    /// The replica name reported in every answer.
    #[arg(long, default_value = "demo-0")]
    replica: String,
    /// Milliseconds added to every answer.
    #[arg(long, default_value = "0")]
    latency_ms: f64,
    /// Fraction of requests answered with an error (0 to 1).
    #[arg(long, default_value = "0")]
    error_rate: f64,
}

impl DemoAppArgs {
    pub async fn run(self, shutdown: Shutdown) -> anyhow::Result<()> {
        let config = DemoConfig::new(self.service, self.replica, self.latency_ms, self.error_rate)?;
        tether_mesh_up::demo_app::run(self.listen, config, shutdown).await?;
        Ok(())
    }
}

/// Send load: open-loop at --rate, or closed-loop at full speed without it. Prints JSON.
#[derive(clap::Args)]
pub struct LoadArgs {
    /// Where to connect: an outbound proxy or the app itself.
    #[arg(long)]
    connect: SocketAddr,
    /// The authority requests name (Host / :authority).
    #[arg(long)]
    authority: String,
    /// The request path.
    #[arg(long, default_value = "/")]
    path: String,
    /// http1, http2 or grpc.
    #[arg(long, default_value = "http1")]
    protocol: LoadProtocol,
    /// Requests per second (open loop). Omit for maximum throughput.
    #[arg(long)]
    rate: Option<f64>,
    /// Seconds to send for.
    #[arg(long, default_value = "10", value_parser = parse_secs)]
    duration: Duration,
    /// Requests in flight at most.
    #[arg(long, default_value = "64")]
    concurrency: usize,
    /// Give every request an `x-request-id` of its own, as a traced app
    /// does (HTTP only).
    #[arg(long)]
    request_ids: bool,
}

impl LoadArgs {
    pub fn into_config(self) -> LoadSpec {
        LoadSpec {
            connect: self.connect,
            authority: self.authority,
            path: self.path,
            protocol: self.protocol,
            rate: self.rate,
            duration: self.duration,
            concurrency: self.concurrency,
            request_ids: self.request_ids,
        }
    }

    pub async fn run(self, shutdown: Shutdown) -> anyhow::Result<()> {
        let report = tether_mesh_up::loadgen::run(self.into_config(), shutdown).await?;
        println!("{}", report.to_json());
        Ok(())
    }
}
