//! One module per subcommand: its flags (`#[derive(Args)]`), the library
//! configuration they make (`into_config`), and running it. Flag groups
//! more than one subcommand takes are in [`args`]; checks a test should
//! reach live in the libraries, not here.

pub mod args;
pub mod control;
pub mod dashboard;
pub mod demo;
pub mod gateway;
pub mod identity;
pub mod ops;
/// `tether proxy`: the flags of the `tether-proxy` binary, from its crate.
pub use tether_proxy_cli::proxy;
pub mod stat;
pub mod tap;
pub mod up;
