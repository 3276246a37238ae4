//! One logical service as the outbound side sees it: its discovery stream,
//! its balancer, its fail-fast watcher, and the bounded queue of requests
//! waiting for it to have an endpoint; and [`ServiceCache`], the services a
//! proxy follows, bounded in number.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use tether_admin::Shutdown;
use tokio::sync::{watch, Semaphore};

use crate::balance::{Balancer, Endpoints};
use crate::discovery::{Discovery, PolicyState, Stall, StreamError};
use crate::errors::ProxyError;
use crate::metrics::{AuthorityLabels, ProxyMetrics, ReasonLabels, Series};
use crate::tls::Connector;

/// Services unused this long are forgotten (and their discovery stream ended).
pub const IDLE_SERVICE: Duration = Duration::from_secs(300);
/// Route names one service labels metrics with; more share `other`.
const MAX_ROUTE_LABELS: usize = 100;
/// Authorities a proxy follows at once by default
/// (`--max-discovery-subscriptions`).
pub const DEFAULT_MAX_SERVICES: usize = 1_000;

pub struct Service {
    pub authority: Arc<str>,
    pub balancer: Balancer,
    pub last_used: Mutex<Instant>,
    failfast: watch::Receiver<bool>,
    /// Requests waiting for an endpoint; beyond its permits they fail at once.
    queue: Semaphore,
    stall: Stall,
    budget: Arc<crate::retry::RetryBudget>,
    /// The profile's response timeout (zero: none), overriding the proxy's.
    response_timeout: watch::Sender<Option<Duration>>,
    /// Ends the discovery stream and the fail-fast watcher with the service.
    stop: Shutdown,
    /// Set for a service the proxy will not follow: every request gets it.
    refused: Option<ProxyError>,
    /// The outbound policy (routes) as it arrives.
    policy: watch::Receiver<PolicyState>,
    /// Route names used as metric labels, removed with the service.
    route_labels: Mutex<HashSet<Arc<str>>>,
    /// The metric series of its requests without a route.
    series: OnceLock<Arc<Series>>,
    /// Its authority, parsed once for every request's next hop.
    pub hop_authority: crate::http::HopAuthority,
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
        let response_timeout = watch::Sender::new(None);
        let policy = watch::Sender::new(PolicyState::Pending);
        let policy_rx = policy.subscribe();
        discovery.watch_policy(authority, policy, stop.clone());
        discovery.watch_profile(
            authority,
            budget.clone(),
            retry_budget,
            response_timeout.clone(),
            stop.clone(),
        );
        Self {
            budget,
            response_timeout,
            authority: authority.into(),
            balancer: Balancer::new(rx, connector, metrics.endpoint_ejections.clone()),
            last_used: Mutex::new(Instant::now()),
            failfast,
            queue: Semaphore::new(max_pending),
            stall,
            stop,
            refused: None,
            policy: policy_rx,
            route_labels: Mutex::default(),
            series: OnceLock::new(),
            hop_authority: crate::http::HopAuthority::new(authority),
        }
    }

    /// A service that is not followed (no discovery stream): its requests
    /// fail with `error`.
    pub fn refused(authority: &str, connector: Arc<Connector>, error: ProxyError) -> Self {
        let (_, rx) = watch::channel(Default::default());
        Self {
            budget: Arc::new(crate::retry::RetryBudget::new(Default::default())),
            response_timeout: watch::Sender::new(None),
            authority: authority.into(),
            balancer: Balancer::new(rx, connector, Default::default()),
            last_used: Mutex::new(Instant::now()),
            failfast: watch::channel(false).1,
            queue: Semaphore::new(0),
            stall: Stall::default(),
            stop: Shutdown::default(),
            refused: Some(error),
            policy: watch::channel(PolicyState::Settled(None)).1,
            route_labels: Mutex::default(),
            series: OnceLock::new(),
            hop_authority: crate::http::HopAuthority::new(authority),
        }
    }

    /// Whether the control plane refused this authority outright.
    fn rejected(&self) -> bool {
        self.balancer.watch().borrow().rejected.is_some()
    }

    pub fn retry_budget(&self) -> Arc<crate::retry::RetryBudget> {
        self.budget.clone()
    }

    /// The profile's response timeout as it arrives (it may come after a
    /// request started); see [`effective_timeout`].
    pub fn response_timeout(&self) -> watch::Receiver<Option<Duration>> {
        self.response_timeout.subscribe()
    }

    /// The outbound policy, when one is in force already (or its absence
    /// is settled): what [`Self::policy`] answers at once, without a wait.
    pub fn settled_policy(&self) -> Option<Option<Arc<crate::policy::ClientPolicy>>> {
        match &*self.policy.borrow() {
            PolicyState::Settled(p) => Some(p.clone()),
            _ => None,
        }
    }

    /// The outbound policy in force, waiting for the first answer at most
    /// as long as a request waits today for discovery: until discovery has
    /// answered (or failed, or the service is in fail-fast), bounded by
    /// `wait`, in the service's bounded wait queue. `Ok(None)`: no policy,
    /// the default path.
    pub async fn policy(
        &self,
        wait: Duration,
    ) -> Result<Option<Arc<crate::policy::ClientPolicy>>, ProxyError> {
        let deadline = tokio::time::Instant::now() + wait;
        let mut policy = self.policy.clone();
        let mut resolution = self.balancer.watch();
        let mut failfast = self.failfast.clone();
        let mut permit = None;
        loop {
            if let PolicyState::Settled(p) = &*policy.borrow_and_update() {
                return Ok(p.clone());
            }
            let discovered = {
                let r = resolution.borrow_and_update();
                r.answered || r.last_error.is_some()
            };
            if discovered || *failfast.borrow_and_update() {
                return Ok(None);
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
                changed = policy.changed() => if changed.is_err() { return Ok(None) },
                changed = resolution.changed() => if changed.is_err() { return Ok(None) },
                changed = failfast.changed() => if changed.is_err() { return Ok(None) },
                _ = tokio::time::sleep_until(deadline) => return Ok(None),
            }
        }
    }

    /// The metric series of the service's requests that took no named
    /// route (never removed while the proxy runs, so they may be kept).
    pub fn series(&self, metrics: &ProxyMetrics) -> Arc<Series> {
        self.series
            .get_or_init(|| Arc::new(metrics.series("outbound", self.authority.clone(), None)))
            .clone()
    }

    /// The metric label for route `name` (bounded per service).
    pub fn route_label(&self, name: &Arc<str>) -> Arc<str> {
        let mut labels = self.route_labels.lock().unwrap();
        if labels.contains(name) {
            return name.clone();
        }
        if labels.len() >= MAX_ROUTE_LABELS {
            let other: Arc<str> = "other".into();
            labels.insert(other.clone());
            return other;
        }
        labels.insert(name.clone());
        name.clone()
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
    pub async fn ready_endpoints(&self, wait: Duration) -> Result<Endpoints, ProxyError> {
        if let Some(e) = &self.refused {
            return Err(e.clone());
        }
        // The usual case, before any clock, receiver or resolution is
        // copied for a wait.
        let endpoints = self.balancer.endpoints();
        if !endpoints.is_empty() {
            return Ok(endpoints);
        }
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
                return Err(ProxyError::UnknownService(match &resolution.rejected {
                    Some(reason) => format!("{} ({reason})", self.authority),
                    None => self.authority.to_string(),
                }));
            }
            if !resolution.answered {
                match &resolution.last_error {
                    Some(StreamError::TooLarge(detail)) => {
                        return Err(ProxyError::DiscoveryMessageTooLarge {
                            authority: self.authority.to_string(),
                            detail: detail.clone(),
                        })
                    }
                    Some(StreamError::Unreachable(_)) => {
                        return Err(ProxyError::ControlPlaneUnreachable)
                    }
                    None => {}
                }
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

/// The services a proxy follows, one discovery subscription each, at most
/// `limit` at once. Past the limit the least recently used idle service
/// (no request holds it) makes room; when none is idle, requests for new
/// authorities are refused with [`ProxyError::DiscoveryLimit`]. Services
/// the control plane refused outright are dropped as soon as they are idle,
/// so an undeclared port holds nothing.
pub struct ServiceCache {
    services: Mutex<HashMap<String, Arc<Service>>>,
    limit: usize,
}

impl ServiceCache {
    pub fn new(limit: usize) -> Self {
        Self {
            services: Mutex::default(),
            limit: limit.max(1),
        }
    }

    /// The service already followed under exactly `authority`, if any.
    pub fn find(&self, authority: &str, now: Instant) -> Option<Arc<Service>> {
        let services = self.services.lock().unwrap();
        let svc = services.get(authority)?;
        *svc.last_used.lock().unwrap() = now;
        Some(svc.clone())
    }

    /// The service for `authority`, made by `make` when it is not followed
    /// yet.
    pub fn get(
        &self,
        authority: &str,
        now: Instant,
        metrics: &ProxyMetrics,
        make: impl FnOnce() -> Service,
    ) -> Result<Arc<Service>, ProxyError> {
        let mut services = self.services.lock().unwrap();
        if let Some(svc) = services.get(authority) {
            *svc.last_used.lock().unwrap() = now;
            return Ok(svc.clone());
        }
        if services.len() >= self.limit {
            let victim = services
                .iter()
                .filter(|(_, s)| Arc::strong_count(s) == 1)
                .min_by_key(|(_, s)| (!s.rejected(), *s.last_used.lock().unwrap()))
                .map(|(a, _)| a.clone());
            let Some(victim) = victim else {
                metrics.refuse_outbound("discovery_subscription_limit");
                return Err(ProxyError::DiscoveryLimit { limit: self.limit });
            };
            if let Some(svc) = services.remove(&victim) {
                forget(&victim, &svc, "lru", metrics);
            }
        }
        let svc = Arc::new(make());
        services.insert(authority.to_string(), svc.clone());
        metrics.discovery_subscriptions.set(services.len() as i64);
        Ok(svc)
    }

    /// Forgets services nobody has used for [`IDLE_SERVICE`], and idle ones
    /// the control plane refused; refreshes each one's discovery metrics.
    pub fn sweep(&self, metrics: &ProxyMetrics) {
        let mut services = self.services.lock().unwrap();
        services.retain(|authority, s| {
            let idle = Arc::strong_count(s) == 1;
            let drop = if !idle {
                None
            } else if s.rejected() {
                Some("rejected")
            } else if s.last_used.lock().unwrap().elapsed() >= IDLE_SERVICE {
                Some("idle")
            } else {
                None
            };
            if let Some(reason) = drop {
                forget(authority, s, reason, metrics);
                return false;
            }
            let labels = AuthorityLabels {
                authority: authority.clone(),
            };
            let age = s.update_age().map_or(-1.0, |a| a.as_secs_f64());
            metrics.discovery_age.get_or_create(&labels).set(age);
            let endpoints = s.balancer.watch().borrow().endpoints.len();
            metrics
                .discovery_endpoints
                .get_or_create(&labels)
                .set(endpoints as i64);
            crate::health::export_states(authority, &s.balancer.endpoints(), metrics);
            true
        });
        let len = services.len();
        if services.capacity() > 64 && len * 4 < services.capacity() {
            services.shrink_to(len * 2);
        }
        metrics.discovery_subscriptions.set(len as i64);
    }

    pub fn len(&self) -> usize {
        self.services.lock().unwrap().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Removes what the metrics say about a service no longer followed.
fn forget(authority: &str, svc: &Service, reason: &str, metrics: &ProxyMetrics) {
    let routes = std::mem::take(&mut *svc.route_labels.lock().unwrap());
    metrics.forget_routes(authority, routes.iter().map(|r| &**r));
    let labels = AuthorityLabels {
        authority: authority.to_string(),
    };
    metrics.discovery_age.remove(&labels);
    metrics.discovery_endpoints.remove(&labels);
    metrics.failfast.remove(&labels);
    crate::health::forget_states(authority, metrics);
    metrics
        .discovery_evictions
        .get_or_create(&ReasonLabels {
            reason: reason.into(),
        })
        .inc();
}

/// A profile's response timeout if it sets one, else `default`; `None`
/// waits as long as the app takes (a profile's zero).
pub fn effective_timeout(profile: Option<Duration>, default: Option<Duration>) -> Option<Duration> {
    match profile {
        Some(t) if t.is_zero() => None,
        Some(t) => Some(t),
        None => default,
    }
}
