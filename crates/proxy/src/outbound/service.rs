//! One logical service as the outbound side sees it: its discovery stream,
//! its balancer, its fail-fast watcher, and the bounded queue of requests
//! waiting for it to have an endpoint.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tether_admin::Shutdown;
use tokio::sync::{watch, Semaphore};

use crate::balance::{Balancer, EndpointHandle};
use crate::discovery::{Discovery, Stall};
use crate::errors::ProxyError;
use crate::metrics::ProxyMetrics;
use crate::tls::Connector;

pub struct Service {
    pub authority: Arc<str>,
    pub balancer: Balancer,
    pub last_used: Mutex<Instant>,
    failfast: watch::Receiver<bool>,
    /// Requests waiting for an endpoint; beyond its permits they fail at once.
    queue: Semaphore,
    stall: Stall,
    budget: Arc<crate::retry::RetryBudget>,
    /// Ends the discovery stream and the fail-fast watcher with the service.
    stop: Shutdown,
}

impl Drop for Service {
    fn drop(&mut self) {
        self.stop.trigger();
    }
}

impl Service {
    pub fn new(
        authority: &str,
        discovery: &Discovery,
        connector: Arc<Connector>,
        failfast_timeout: Duration,
        max_pending: usize,
        retry_budget: crate::retry::BudgetSpec,
        metrics: &ProxyMetrics,
    ) -> Self {
        let stall = Stall::default();
        let rx = discovery.resolve(authority, stall.clone());
        let stop = Shutdown::default();
        let failfast = crate::failfast::spawn(
            authority.to_string(),
            rx.clone(),
            failfast_timeout,
            metrics.clone(),
            stop.clone(),
        );
        let budget = Arc::new(crate::retry::RetryBudget::new(retry_budget));
        discovery.watch_profile(authority, budget.clone(), retry_budget, stop.clone());
        Self {
            budget,
            authority: authority.into(),
            balancer: Balancer::new(rx, connector),
            last_used: Mutex::new(Instant::now()),
            failfast,
            queue: Semaphore::new(max_pending),
            stall,
            stop,
        }
    }

    pub fn retry_budget(&self) -> Arc<crate::retry::RetryBudget> {
        self.budget.clone()
    }

    /// Tells discovery that every endpoint it gave is failing.
    pub fn report_stall(&self) {
        self.stall.notify_one();
    }

    /// Seconds since the last discovery update, if any.
    pub fn update_age(&self) -> Option<Duration> {
        self.balancer
            .watch()
            .borrow()
            .last_update
            .map(|t| t.elapsed())
    }

    /// The service's endpoints, waiting (in the bounded queue, at most
    /// `wait`) while it has none and is not in fail-fast. Known answers
    /// come at once: unknown service, control plane never reached, fail-fast.
    pub async fn ready_endpoints(
        &self,
        wait: Duration,
    ) -> Result<Vec<Arc<EndpointHandle>>, ProxyError> {
        let deadline = tokio::time::Instant::now() + wait;
        let mut rx = self.balancer.watch();
        let mut failfast = self.failfast.clone();
        let mut permit = None;
        loop {
            let resolution = rx.borrow_and_update().clone();
            let endpoints = self.balancer.endpoints();
            if !endpoints.is_empty() {
                return Ok(endpoints);
            }
            if resolution.answered && !resolution.exists {
                return Err(ProxyError::UnknownService(self.authority.to_string()));
            }
            let unreachable = !resolution.answered && resolution.last_error.is_some();
            if unreachable {
                return Err(ProxyError::ControlPlaneUnreachable);
            }
            let give_up = || {
                if resolution.answered {
                    ProxyError::FailFast
                } else {
                    ProxyError::ControlPlaneUnreachable
                }
            };
            if *failfast.borrow_and_update() {
                return Err(give_up());
            }
            if permit.is_none() {
                permit = Some(
                    self.queue
                        .try_acquire()
                        .map_err(|_| ProxyError::QueueFull {
                            authority: self.authority.to_string(),
                        })?,
                );
            }
            tokio::select! {
                _ = rx.changed() => {}
                _ = failfast.changed() => {}
                _ = tokio::time::sleep_until(deadline) => return Err(give_up()),
            }
        }
    }
}
