//! `tether up`: a whole mesh on this machine.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use tether_admin::Shutdown;
use tether_mesh_up::manifest::{Manifest, DEMO, MULTICLUSTER_DEMO};

use super::args::parse_secs;

/// Run a whole mesh on this machine from a manifest (the built-in demo without one).
#[derive(clap::Args)]
pub struct UpArgs {
    /// Manifest file (YAML); see docs/up.md for the format.
    file: Option<PathBuf>,
    /// Run headless for SECS seconds, print a summary, exit non-zero if no request succeeded.
    #[arg(long, value_parser = parse_secs)]
    duration: Option<Duration>,
    /// Seconds between live traffic reports.
    #[arg(long, default_value = "2", value_parser = parse_secs)]
    interval: Duration,
    /// Print the built-in demo manifest and exit.
    #[arg(long)]
    print_demo: bool,
    /// Run the built-in multicluster demo (two clusters, failover).
    #[arg(long, conflicts_with = "file")]
    multicluster: bool,
    /// Also print the summary as a JSON line (`summary-json {...}`).
    #[arg(long)]
    json: bool,
    /// Where to write the mesh state file that `tether stat`, `tether tap` and
    /// `tether dashboard` read (default: tether-up.json in the temp directory).
    #[arg(long, env = tether_viz::state::STATE_ENV)]
    state: Option<PathBuf>,
}

impl UpArgs {
    pub fn into_config(self) -> anyhow::Result<tether_mesh_up::up::UpConfig> {
        let manifest = match &self.file {
            Some(path) => Manifest::load(path)?,
            None if self.multicluster => Manifest::multicluster_demo(),
            None => Manifest::demo(),
        };
        let exe = std::env::current_exe().context("locating the tether binary")?;
        Ok(tether_mesh_up::up::UpConfig {
            proxy: tether_mesh_up::process::ProxyCommand::beside(&exe),
            exe,
            manifest,
            duration: self.duration,
            interval: self.interval,
            json: self.json,
            state: self.state.unwrap_or_else(tether_viz::state::default_path),
        })
    }

    pub async fn run(self, shutdown: Shutdown) -> anyhow::Result<()> {
        if self.print_demo {
            let demo = if self.multicluster {
                MULTICLUSTER_DEMO
            } else {
                DEMO
            };
            print!("{}", demo.trim_start());
            return Ok(());
        }
        let headless = self.duration.is_some();
        let outcome = tether_mesh_up::up::run(self.into_config()?, shutdown).await?;
        anyhow::ensure!(
            !headless || outcome.report.succeeded > 0,
            "no request succeeded"
        );
        Ok(())
    }
}
