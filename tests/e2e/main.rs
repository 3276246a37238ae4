//! End-to-end tests: real `tether` processes on loopback, ports chosen by
//! the OS. One file per behaviour; `support` starts processes and speaks
//! HTTP.

#![forbid(unsafe_code)]

mod support;

mod balancing;
mod check;
mod control_tls;
mod dashboard;
mod diagnostics;
mod discovery;
mod discovery_limits;
mod drain;
mod errors;
mod failover;
mod gateway;
mod hostile;
mod identity;
mod inbound_policy_api;
mod intercept;
mod interop;
mod multicluster;
mod outage;
mod policy;
mod protocols;
mod proxy_binary;
mod registry;
mod retries;
mod rotation;
mod routes;
mod routes_api;
mod stalled_reader;
mod stat;
mod tap;
mod threads;
mod up;
mod websocket;
