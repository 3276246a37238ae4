//! `tether tap`: a live stream of the requests through proxies.

use std::net::SocketAddr;
use std::path::PathBuf;

use tether_viz::state::{self, MeshState};
use tether_viz::tap::{self, TapFilter, TapTarget};

#[derive(Clone, Copy, PartialEq, clap::ValueEnum)]
enum Output {
    Text,
    Json,
}

/// Watch requests live: method, authority, path, status, latency, identities, endpoint.
#[derive(clap::Args)]
pub struct TapArgs {
    /// Tap only these workloads' proxies (repeatable); default: every proxy
    /// of the mesh `tether up` runs.
    #[arg(long)]
    to: Vec<String>,
    /// A proxy's tap address (its --tap), instead of the state file (repeatable).
    #[arg(long = "tap", conflicts_with = "to")]
    taps: Vec<SocketAddr>,
    /// The mesh state file `tether up` wrote.
    #[arg(long, env = state::STATE_ENV)]
    state: Option<PathBuf>,
    /// Only requests for this authority.
    #[arg(long)]
    authority: Option<String>,
    /// Only requests whose path starts with this.
    #[arg(long)]
    path: Option<String>,
    /// Only requests with this method.
    #[arg(long)]
    method: Option<String>,
    /// Only responses with this status (503) or class (5xx, grpc_error, error).
    #[arg(long)]
    status: Option<String>,
    /// Show request headers (values only for the proxies' --tap-header list).
    #[arg(long)]
    headers: bool,
    /// Stop after this many requests.
    #[arg(long)]
    max: Option<u64>,
    /// Output format: a line of text, or a JSON object, per request.
    #[arg(short = 'o', long, value_enum, default_value = "text")]
    output: Output,
}

impl TapArgs {
    pub async fn run(self) -> anyhow::Result<()> {
        let targets = self.targets()?;
        anyhow::ensure!(!targets.is_empty(), "no proxy to tap");
        let filter = TapFilter {
            authority: self.authority.clone(),
            path_prefix: self.path.clone(),
            method: self.method.clone(),
            status: self.status.clone(),
            headers: self.headers,
        };
        let (tx, mut rx) = tokio::sync::mpsc::channel(1024);
        let mut tasks = Vec::new();
        for t in &targets {
            tasks.push(tap::observe(t.clone(), filter.clone(), tx.clone()).await?);
        }
        drop(tx);
        eprintln!("tether tap: observing {} proxies", targets.len());
        let mut printed = 0;
        while let Some(line) = rx.recv().await {
            match self.output {
                Output::Text => println!("{}", tap::render(&line)),
                Output::Json => println!("{}", serde_json::to_string(&line)?),
            }
            printed += 1;
            if self.max.is_some_and(|m| printed >= m) {
                break;
            }
        }
        for t in tasks {
            t.abort();
        }
        Ok(())
    }

    fn targets(&self) -> anyhow::Result<Vec<TapTarget>> {
        if !self.taps.is_empty() {
            return Ok(self
                .taps
                .iter()
                .map(|a| TapTarget {
                    workload: a.to_string(),
                    addr: *a,
                })
                .collect());
        }
        let path = self.state.clone().unwrap_or_else(state::default_path);
        let mesh = MeshState::load(&path)?;
        for w in &self.to {
            anyhow::ensure!(
                mesh.proxies().any(|(_, p)| &p.workload == w),
                "no workload {w:?} in {}",
                path.display()
            );
        }
        Ok(mesh
            .proxies()
            .filter(|(_, p)| self.to.is_empty() || self.to.contains(&p.workload))
            .filter_map(|(_, p)| {
                Some(TapTarget {
                    workload: p.workload.clone(),
                    addr: p.tap?,
                })
            })
            .collect())
    }
}
