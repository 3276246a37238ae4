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
    /// Root rotation, step 1 of 3: make a new root and make ca.crt trust the
    /// old and the new one (then wait until every proxy trusts it).
    RotateRoot {
        /// The identity directory.
        #[arg(long)]
        dir: PathBuf,
        /// New root certificate lifetime in seconds (default ten years).
        #[arg(long, default_value = "315360000", value_parser = parse_secs)]
        root_lifetime: Duration,
    },
    /// Root rotation, step 2 of 3: a new issuer from the new root (outside a
    /// root rotation: a new issuer from the current root). The control plane
    /// signs with it within a second; proxies move to it as they renew.
    RotateIssuer {
        /// The identity directory.
        #[arg(long)]
        dir: PathBuf,
        /// New issuer certificate lifetime in seconds (default one year).
        #[arg(long, default_value = "31536000", value_parser = parse_secs)]
        issuer_lifetime: Duration,
    },
    /// Root rotation, step 3 of 3: ca.crt trusts only the new root (once
    /// every proxy holds a certificate from the new issuer).
    Finish {
        /// The identity directory.
        #[arg(long)]
        dir: PathBuf,
    },
    /// Where a root rotation stands, and what to do next.
    Status {
        /// The identity directory.
        #[arg(long)]
        dir: PathBuf,
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
            Self::RotateRoot { dir, root_lifetime } => {
                let status = tether_identity::rotation::rotate_root(&dir, root_lifetime)?;
                println!(
                    "step 1 of 3 done: {} now trusts the old and the new root ({})",
                    dir.join("ca.crt").display(),
                    status.roots.join(", ")
                );
                print_status(&status);
            }
            Self::RotateIssuer {
                dir,
                issuer_lifetime,
            } => {
                let status = tether_identity::rotation::rotate_issuer(&dir, issuer_lifetime)?;
                let from = match status.step {
                    tether_identity::rotation::Step::Steady => "the current root",
                    _ => "the new root (step 2 of 3 done)",
                };
                println!(
                    "new issuer {} from {from}, expires at {}",
                    status.issuer,
                    when(status.issuer_not_after)
                );
                println!("control planes reading {} sign with it within a second; proxies move to it at their next renewal", dir.display());
                print_status(&status);
            }
            Self::Finish { dir } => {
                let status = tether_identity::rotation::finish(&dir)?;
                println!(
                    "step 3 of 3 done: {} trusts only the new root {}; ca.key is its key",
                    dir.join("ca.crt").display(),
                    status.roots.join(", ")
                );
                println!("give the new ca.crt to every proxy; each drops the old root within a second of seeing it");
            }
            Self::Status { dir } => {
                let status = tether_identity::rotation::status(&dir)?;
                println!("trust roots: {}", status.roots.join(", "));
                println!(
                    "issuer:      {} (expires at {})",
                    status.issuer,
                    when(status.issuer_not_after)
                );
                print_status(&status);
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

fn print_status(status: &tether_identity::rotation::Status) {
    println!("next: {}", status.next());
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
