//! `tether up`: a whole mesh on this machine, and the programs it runs.
//!
//! - [`manifest`]: the topology file (services, replicas, demo-app behaviour,
//!   load), its validation, and the built-in demo.
//! - [`up`]: the orchestrator: starts the control plane, every workload with
//!   its sidecar, writes the registry as workloads start and stop, shows live
//!   traffic, and stops everything on Ctrl-C.
//! - [`process`]: child processes that die with their parent and announce
//!   their listeners.
//! - [`demo_app`] and [`demo_grpc`]: the demo workload (HTTP and gRPC with
//!   settable latency and error rate).
//! - [`loadgen`]: an open-loop load generator (constant rate, latency
//!   measured from the intended send time, so no coordinated omission).
//! - [`stats`]: reads proxies' metrics into per-service success rate, RPS
//!   and latency percentiles.

pub mod demo_app;
pub mod demo_grpc;
pub mod loadgen;
pub mod manifest;
pub mod ports;
pub mod process;
pub mod stats;
pub mod up;
