//! `tether stat`: golden metrics per service, workload or route.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use tether_viz::prometheus::Prometheus;
use tether_viz::stat::{self, GroupBy, Target};
use tether_viz::state::{self, MeshState};

use super::args::parse_positive_secs;

#[derive(Clone, Copy, clap::ValueEnum)]
enum By {
    /// Outbound requests by the authority clients asked for, over every proxy.
    Service,
    /// Requests each replica's sidecar served (inbound).
    Workload,
    /// A service's outbound requests by route.
    Route,
}

#[derive(Clone, Copy, PartialEq, clap::ValueEnum)]
enum Output {
    Table,
    Json,
}

/// Success rate, RPS, p50/p95/p99 latency and mTLS share over a window.
#[derive(clap::Args)]
pub struct StatArgs {
    /// What one row is.
    #[arg(long, value_enum, default_value = "service")]
    by: By,
    /// Seconds to count over.
    #[arg(long, short = 'w', default_value = "10", value_parser = parse_positive_secs)]
    window: Duration,
    /// A proxy's admin address to scrape (repeat it); default: every proxy of
    /// the mesh `tether up` runs, from its state file.
    #[arg(long = "admin")]
    admins: Vec<SocketAddr>,
    /// The mesh state file `tether up` wrote.
    #[arg(long, env = state::STATE_ENV)]
    state: Option<PathBuf>,
    /// Ask this Prometheus (http://host:port) instead of scraping proxies.
    #[arg(long, conflicts_with = "admins")]
    prometheus: Option<String>,
    /// Output format.
    #[arg(short = 'o', long, value_enum, default_value = "table")]
    output: Output,
}

impl StatArgs {
    pub async fn run(self) -> anyhow::Result<()> {
        let by = match self.by {
            By::Service => GroupBy::Service,
            By::Workload => GroupBy::Workload,
            By::Route => GroupBy::Route,
        };
        let rows = match &self.prometheus {
            Some(url) => {
                Prometheus::connect(url)
                    .await?
                    .stat(by, self.window)
                    .await?
            }
            None => {
                let targets = self.targets()?;
                let window = self.window;
                stat::scrape_window(&targets, by, window, |n| {
                    eprintln!(
                        "tether stat: counting {n} of {} proxies for {}s",
                        targets.len(),
                        window.as_secs_f64()
                    )
                })
                .await
            }
        };
        match self.output {
            Output::Table => print!("{}", stat::render(by, &rows)),
            Output::Json => println!("{}", serde_json::to_string_pretty(&rows)?),
        }
        Ok(())
    }

    fn targets(&self) -> anyhow::Result<Vec<Target>> {
        if !self.admins.is_empty() {
            return Ok(self
                .admins
                .iter()
                .map(|a| Target {
                    workload: a.to_string(),
                    admin: *a,
                })
                .collect());
        }
        let path = self.state.clone().unwrap_or_else(state::default_path);
        Ok(MeshState::load(&path)?.targets())
    }
}
