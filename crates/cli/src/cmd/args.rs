//! Flag groups and value parsers shared by several subcommands. They live
//! with the proxy's flags in `tether-proxy-cli`, which the `tether-proxy`
//! binary shares, so both binaries parse them alike.

pub use tether_proxy_cli::args::*;
