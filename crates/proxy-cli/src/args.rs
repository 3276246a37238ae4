//! Flag groups and value parsers shared by several subcommands.

use std::path::PathBuf;
use std::time::Duration;

/// A number of seconds (fractions allowed), at most 10^9.
pub fn parse_secs(s: &str) -> Result<Duration, String> {
    let v: f64 = s
        .parse()
        .map_err(|_| format!("{s:?} is not a number of seconds"))?;
    if !(0.0..=1e9).contains(&v) {
        return Err(format!("{s} seconds is out of range"));
    }
    Ok(Duration::from_secs_f64(v))
}

/// Like [`parse_secs`], but more than 0.
pub fn parse_positive_secs(s: &str) -> Result<Duration, String> {
    let d = parse_secs(s)?;
    if d.is_zero() {
        return Err("must be more than 0 seconds".into());
    }
    Ok(d)
}

/// A count given as `u64` (so clap can range-check it), as `usize`.
pub fn count(n: u64) -> usize {
    usize::try_from(n).unwrap_or(usize::MAX)
}

/// Bounds of the data-path listeners, shared by `proxy` and `gateway`.
#[derive(clap::Args)]
pub struct ServeArgs {
    /// Client connections open at once, all listeners together (default:
    /// half the fd limit left after a reserve for admin and control plane).
    #[arg(long)]
    pub max_connections: Option<usize>,
    /// Seconds a client may take to send a request's HTTP/1 headers: an
    /// HTTP/1 connection with no request in flight is closed between one
    /// and two of these after its last request (the shorter idle bound).
    #[arg(long, default_value = "10", value_parser = parse_positive_secs)]
    pub header_read_timeout: Duration,
    /// Seconds a client connection may stay open with no request in flight;
    /// also how long a response may wait for a client that reads none of it
    /// (the HTTP/1 connection is closed, the HTTP/2 stream reset).
    #[arg(long, default_value = "60", value_parser = parse_positive_secs)]
    pub idle_timeout: Duration,
    /// Seconds an outbound request may wait for response headers, all
    /// attempts together (504 after it); 0 waits as long as the app takes.
    /// A service's `response_timeout` in the registry overrides it.
    #[arg(long, default_value = "60", value_parser = parse_secs)]
    pub response_timeout: Duration,
}

impl ServeArgs {
    pub fn serve_config(&self) -> tether_proxy::serve::ServeConfig {
        tether_proxy::serve::ServeConfig {
            max_connections: self.max_connections,
            header_read_timeout: self.header_read_timeout,
            idle_timeout: self.idle_timeout,
        }
    }

    pub fn response_timeout(&self) -> Option<Duration> {
        (!self.response_timeout.is_zero()).then_some(self.response_timeout)
    }
}

/// What every process that follows a control plane and serves traffic
/// (`proxy`, `gateway`) takes: where the control plane is, the admin
/// listener, connect and drain timeouts, and listener bounds.
#[derive(clap::Args)]
pub struct BootstrapArgs {
    /// Control-plane gRPC address(es), comma-separated, tried in turn.
    #[arg(long, value_delimiter = ',', required = true)]
    pub control: Vec<String>,
    /// Admin listener (/live, /ready, /metrics).
    #[arg(long, default_value = "127.0.0.1:4191")]
    pub admin: std::net::SocketAddr,
    /// Seconds a request waits for a service to have a ready endpoint.
    #[arg(long, default_value = "3", value_parser = parse_secs)]
    pub failfast_timeout: Duration,
    /// Seconds to wait for a TCP connection to an endpoint.
    #[arg(long, default_value = "1", value_parser = parse_secs)]
    pub connect_timeout: Duration,
    /// Seconds in-flight requests get to finish on SIGTERM.
    #[arg(long, default_value = "10", value_parser = parse_secs)]
    pub drain_timeout: Duration,
    /// The identity the control plane must present over TLS (default:
    /// tether-control.tether-system.serviceaccount.identity.<trust domain of --identity>).
    #[arg(long)]
    pub control_identity: Option<String>,
    /// Talk to the control plane in plaintext gRPC (the control plane must
    /// allow it too); without it the channel is TLS and needs --identity.
    #[arg(long)]
    pub insecure_control_plane: bool,
    /// Runtime worker threads (default: the container's CPU quota from
    /// cgroup v2 cpu.max, rounded up, else 1: a sidecar's share of a host).
    #[arg(long, env = "TETHER_PROXY_THREADS", value_parser = clap::value_parser!(u64).range(1..=1024))]
    pub threads: Option<u64>,
    #[command(flatten)]
    pub serve: ServeArgs,
    /// Serve the tap API (`tether tap`) on this address; off without it.
    /// Loopback peers may tap; others only over mTLS as --tap-allow-identity.
    #[arg(long)]
    pub tap: Option<std::net::SocketAddr>,
    /// An identity allowed to tap from elsewhere than loopback (repeatable).
    #[arg(long, requires = "tap")]
    pub tap_allow_identity: Vec<String>,
    /// A header whose value taps may see (repeatable; replaces the default
    /// list content-type, user-agent, grpc-status). Other values show as
    /// [redacted].
    #[arg(long, requires = "tap")]
    pub tap_header: Vec<String>,
}

impl BootstrapArgs {
    /// Worker threads for this process's runtime (see `--threads`).
    pub fn worker_threads(&self) -> usize {
        tether_admin::threads::data_path_worker_threads(self.threads.map(count))
    }

    pub fn into_config(
        self,
        identity: Option<tether_proxy::identity::IdentityConfig>,
        tls_mode: tether_proxy::tls::TlsMode,
        discovery: tether_proxy::discovery::DiscoverySettings,
    ) -> tether_proxy::bootstrap::BootstrapConfig {
        tether_proxy::bootstrap::BootstrapConfig {
            control: self.control,
            admin: self.admin,
            identity,
            tls_mode,
            connect_timeout: self.connect_timeout,
            drain_timeout: self.drain_timeout,
            discovery,
            serve: self.serve.serve_config(),
            tap: self.tap.map(|listen| tether_proxy::tap::TapConfig {
                listen,
                allowed_identities: self.tap_allow_identity,
                headers: if self.tap_header.is_empty() {
                    tether_proxy::tap::DEFAULT_HEADERS
                        .map(String::from)
                        .to_vec()
                } else {
                    self.tap_header
                },
            }),
            control_channel: tether_proxy::bootstrap::ControlChannel {
                insecure: self.insecure_control_plane,
                identity: self.control_identity,
            },
        }
    }
}

/// A workload identity, certified by the control plane: shared by `proxy`
/// (where it is optional) and `gateway` (where it is required).
#[derive(clap::Args)]
pub struct IdentityArgs {
    /// This process's identity, e.g.
    /// web.demo.serviceaccount.identity.cluster.local; certified by the
    /// control plane with the token of --identity-token-file.
    #[arg(long, requires_all = ["identity_token_file", "trust_root"])]
    pub identity: Option<String>,
    /// File holding the bootstrap token for --identity (re-read at every
    /// renewal).
    #[arg(long)]
    pub identity_token_file: Option<PathBuf>,
    /// The trust root (PEM) peers' certificates must chain to.
    #[arg(long)]
    pub trust_root: Option<PathBuf>,
}

impl IdentityArgs {
    /// The identity, if given; a token file that cannot be read is refused
    /// at start-up rather than at the first certificate request.
    pub fn into_config(self) -> anyhow::Result<Option<tether_proxy::identity::IdentityConfig>> {
        let (Some(name), Some(token_file), Some(trust_root)) =
            (self.identity, self.identity_token_file, self.trust_root)
        else {
            return Ok(None);
        };
        let config = tether_proxy::identity::IdentityConfig {
            name,
            token_file,
            trust_root,
        };
        config
            .read_token()
            .map_err(|e| anyhow::anyhow!("--identity-token-file: {e}"))?;
        Ok(Some(config))
    }
}
