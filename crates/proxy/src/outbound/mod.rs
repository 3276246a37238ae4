//! The outbound side: requests from the local app to mesh services, as a
//! sequence of steps, one module each:
//!
//! 0. [`accept`]: from connection to request — the outbound listener,
//!    intercepted connections (by original destination), `--upstream`
//!    listeners; a port declared opaque goes to [`opaque`] instead.
//! 1. [`logical`]: from request to logical service — the authority names a
//!    [`service::Service`] (one discovery stream, one balancer, one
//!    fail-fast watcher); the service's response timeout bounds the rest.
//! 2. [`route`]: ready endpoints (waiting in a bounded queue at most the
//!    fail-fast timeout), retries within the budget, the kept body; or,
//!    when discovery cannot route, [`forward`] to the original destination.
//! 3. [`endpoint`]: pick by P2C, connect (another endpoint when a
//!    connection cannot be made: nothing was sent), rewrite for the hop,
//!    send over a pooled connection (HTTP/2, mTLS when possible, to peer
//!    proxies).
//!
//! A per-route policy belongs in step 2, an upgrade handler in step 1 or 3.

mod accept;
mod endpoint;
pub mod forward;
mod logical;
mod opaque;
mod route;
pub mod service;

use std::sync::Arc;
use std::time::Duration;

use tether_admin::{Readiness, Shutdown};

use self::forward::{Forwarder, Unavailable};
use self::service::{Service, ServiceCache};
use crate::discovery::Discovery;
use crate::metrics::ProxyMetrics;
use crate::retry::BudgetSpec;
use crate::tls::Connector;

/// Endpoints tried per request (or opaque connection) when connections fail.
const CONNECT_ATTEMPTS: usize = 3;

/// How the outbound routes, shared by the sidecar and the gateway.
#[derive(Clone, Debug)]
pub struct OutboundConfig {
    /// How long a request waits for a service to have an endpoint.
    pub failfast_timeout: Duration,
    /// Requests that may wait per service for an endpoint.
    pub max_pending: usize,
    /// What to do when the control plane cannot route a request.
    pub control_plane_unavailable: Unavailable,
    /// The default retry budget (a service's profile may override it).
    pub retry_budget: BudgetSpec,
    /// How long a request may wait for response headers, all attempts
    /// together (a service's profile may override it); `None`: no limit.
    pub response_timeout: Option<Duration>,
    /// Authorities followed at once (`--max-discovery-subscriptions`).
    pub max_subscriptions: usize,
}

impl Default for OutboundConfig {
    fn default() -> Self {
        Self {
            failfast_timeout: Duration::from_secs(3),
            max_pending: 100,
            control_plane_unavailable: Unavailable::Fail,
            retry_budget: BudgetSpec::default(),
            response_timeout: Some(Duration::from_secs(60)),
            max_subscriptions: service::DEFAULT_MAX_SERVICES,
        }
    }
}

pub struct Outbound {
    discovery: Discovery,
    services: ServiceCache,
    metrics: ProxyMetrics,
    failfast_timeout: Duration,
    max_pending: usize,
    connector: Arc<Connector>,
    unavailable: Unavailable,
    forwarder: Forwarder,
    retry_budget: BudgetSpec,
    response_timeout: Option<Duration>,
}

impl Outbound {
    pub fn new(
        discovery: Discovery,
        metrics: ProxyMetrics,
        config: &OutboundConfig,
        connector: Arc<Connector>,
    ) -> Self {
        Self {
            discovery,
            services: ServiceCache::new(config.max_subscriptions),
            metrics,
            failfast_timeout: config.failfast_timeout,
            max_pending: config.max_pending,
            forwarder: Forwarder::new(connector.connect_timeout),
            connector,
            unavailable: config.control_plane_unavailable,
            retry_budget: config.retry_budget,
            response_timeout: config.response_timeout,
        }
    }

    fn service(&self, authority: &str) -> Arc<Service> {
        self.service_at(authority, std::time::Instant::now())
    }

    /// The service a request names by `authority` (as written), used at
    /// `now`. Every service is followed under its normal authority, so an
    /// authority found as it is needs no normalising (the usual case:
    /// parsing it costs more than the lookup).
    fn service_named(
        &self,
        authority: &str,
        now: std::time::Instant,
    ) -> Result<Arc<Service>, crate::errors::ProxyError> {
        if let Some(svc) = self.services.find(authority, now) {
            return Ok(svc);
        }
        logical::normalize(authority).map(|normal| self.service_at(&normal, now))
    }

    /// [`Self::service`], used at `now` (a request's start: no clock read).
    fn service_at(&self, authority: &str, now: std::time::Instant) -> Arc<Service> {
        let make = || {
            Service::new(
                authority,
                &self.discovery,
                self.connector.clone(),
                self.failfast_timeout,
                self.max_pending,
                self.retry_budget,
                &self.metrics,
            )
        };
        self.services
            .get(authority, now, &self.metrics, make)
            .unwrap_or_else(|e| Arc::new(Service::refused(authority, self.connector.clone(), e)))
    }

    /// Resolves `authorities` at start and holds the proxy not-ready until
    /// the control plane has answered for each (`--require-discovery`).
    pub fn require_discovery(
        self: &Arc<Self>,
        authorities: &[String],
        readiness: &Readiness,
    ) -> Vec<Arc<Service>> {
        let mut pinned = Vec::new();
        for authority in authorities {
            let Ok(authority) = logical::normalize(authority) else {
                continue;
            };
            let condition = format!("discovery of {authority}");
            readiness.require(condition.clone());
            let svc = self.service(&authority);
            let mut rx = svc.balancer.watch();
            let readiness = readiness.clone();
            tokio::spawn(async move {
                if rx.wait_for(|r| r.answered).await.is_ok() {
                    readiness.set(&condition, true);
                }
            });
            pinned.push(svc);
        }
        pinned
    }

    /// Forgets services nobody has used for a while; refreshes the age of
    /// each service's last discovery update.
    pub async fn maintain(self: Arc<Self>, shutdown: Shutdown) {
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                _ = shutdown.triggered() => return,
            }
            self.services.sweep(&self.metrics);
        }
    }
}
