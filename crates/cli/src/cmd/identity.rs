//! `tether identity`: the mesh's trust root, issuer and bootstrap tokens.

use std::path::PathBuf;
use std::time::{Duration, SystemTime};

use anyhow::Context;

use super::args::parse_secs;

#[derive(clap::Subcommand)]
pub enum IdentityCommand {
    /// Create a trust root and an issuer (ECDSA P-256) and a token secret.
    Init {
        /// The directory to write them to.
        #[arg(long)]
        out: PathBuf,
        /// The trust domain identities end in.
        #[arg(long, default_value = "cluster.local")]
        trust_domain: String,
        /// Replace existing files.
        #[arg(long)]
        force: bool,
        /// Issuer certificate lifetime in seconds (default one year).
        #[arg(long, default_value = "31536000", value_parser = parse_secs)]
        issuer_lifetime: Duration,
    },
    /// Print the bootstrap token that entitles a workload to IDENTITY.
    Token {
        /// The identity directory (holds token.key).
        #[arg(long)]
        dir: PathBuf,
        /// e.g. web.demo.serviceaccount.identity.cluster.local
        identity: String,
    },
}

impl IdentityCommand {
    pub fn run(self) -> anyhow::Result<()> {
        match self {
            Self::Init {
                out,
                trust_domain,
                force,
                issuer_lifetime,
            } => {
                let mut opts = tether_identity::ca::InitOptions::new(&out, &trust_domain);
                opts.force = force;
                opts.issuer_lifetime = issuer_lifetime;
                let report = tether_identity::ca::init(&opts)?;
                println!("created trust root and issuer for trust domain {trust_domain}:");
                for f in &report.files {
                    println!("  {}", f.display());
                }
                println!("trust root expires at {}", when(report.root_expires));
                println!("issuer expires at     {}", when(report.issuer_expires));
                println!(
                    "give {} to every proxy (--trust-root); keep ca.key offline",
                    out.join("ca.crt").display()
                );
            }
            Self::Token { dir, identity } => {
                let tokens = tether_identity::token::LocalTokens::load(&dir)
                    .with_context(|| format!("reading the token secret in {}", dir.display()))?;
                println!("{}", tokens.issue(&identity));
            }
        }
        Ok(())
    }
}

fn when(t: SystemTime) -> String {
    let secs = t
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs();
    let days = t
        .duration_since(SystemTime::now())
        .unwrap_or_default()
        .as_secs_f64()
        / 86400.0;
    format!("unix time {secs} (in {days:.0} days)")
}
