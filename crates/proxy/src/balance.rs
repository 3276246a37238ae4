//! Load balancing: power of two choices over peak-EWMA latency.
//!
//! Each endpoint keeps a latency estimate that jumps up at once to any
//! slower observation (the peak) and decays towards faster ones with time
//! constant `DECAY`. Its load is that estimate times (requests in flight +
//! 1), divided by its weight. A pick samples two endpoints at random and
//! takes the less loaded, which sends most traffic to fast endpoints while
//! still probing slow ones now and then. Endpoints whose connections are
//! failing sit out for a backoff while any other endpoint is available.
//!
//! A new endpoint starts at the mean estimate of the endpoints already
//! there (or a default when there are none): starting it slower would
//! starve it behind fast incumbents until its estimate decayed, starting it
//! at zero would flood it.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rand::Rng;
use tokio::sync::watch;

use crate::client::EndpointClient;
use crate::discovery::{Endpoint, Resolution};
use crate::tls::Connector;

const DECAY: Duration = Duration::from_secs(10);
/// The estimate an endpoint starts with, before any observation.
const DEFAULT_RTT: Duration = Duration::from_millis(30);
const FAILURE_BACKOFF: Duration = Duration::from_secs(1);

#[derive(Debug)]
struct PeakEwma {
    estimate_ns: f64,
    last: Instant,
}

impl PeakEwma {
    fn new(estimate_ns: f64) -> Self {
        Self {
            estimate_ns,
            last: Instant::now(),
        }
    }

    /// The estimate as of `now`: it decays towards zero while nothing is
    /// observed, so an endpoint that had one slow answer is tried again
    /// rather than starved forever.
    fn decayed(&self, now: Instant) -> f64 {
        let idle = now.saturating_duration_since(self.last).as_nanos() as f64;
        self.estimate_ns * (-idle / DECAY.as_nanos() as f64).exp()
    }

    fn observe(&mut self, rtt: Duration, now: Instant) {
        let rtt = rtt.as_nanos() as f64;
        if rtt > self.estimate_ns {
            self.estimate_ns = rtt;
        } else {
            let elapsed = now.saturating_duration_since(self.last).as_nanos() as f64;
            let w = (-elapsed / DECAY.as_nanos() as f64).exp();
            self.estimate_ns = self.estimate_ns * w + rtt * (1.0 - w);
        }
        self.last = now;
    }
}

// === impl EndpointHandle ===

pub struct EndpointHandle {
    pub endpoint: Endpoint,
    pub client: EndpointClient,
    ewma: Mutex<PeakEwma>,
    in_flight: AtomicUsize,
    failing_until: Mutex<Option<Instant>>,
}

impl EndpointHandle {
    fn new(endpoint: Endpoint, connector: Arc<Connector>, estimate_ns: f64) -> Self {
        Self {
            client: EndpointClient::new(endpoint.addr, endpoint.identity.clone(), connector),
            endpoint,
            ewma: Mutex::new(PeakEwma::new(estimate_ns)),
            in_flight: AtomicUsize::new(0),
            failing_until: Mutex::new(None),
        }
    }

    pub fn load(&self) -> f64 {
        let estimate = self.ewma.lock().unwrap().decayed(Instant::now());
        let pending = self.in_flight.load(Ordering::Relaxed) as f64;
        estimate * (pending + 1.0) / self.endpoint.weight as f64
    }

    fn failing_at(&self, now: Instant) -> bool {
        self.failing_until.lock().unwrap().is_some_and(|t| t > now)
    }

    /// Whether connections to this endpoint are failing right now.
    pub fn is_failing(&self) -> bool {
        self.failing_at(Instant::now())
    }

    pub fn mark_failed(&self) {
        *self.failing_until.lock().unwrap() = Some(Instant::now() + FAILURE_BACKOFF);
    }

    /// Counts a request in flight until the guard drops.
    pub fn start(self: &Arc<Self>) -> InFlight {
        self.in_flight.fetch_add(1, Ordering::Relaxed);
        InFlight(self.clone())
    }
}

pub struct InFlight(Arc<EndpointHandle>);

impl InFlight {
    pub fn observe(&self, rtt: Duration) {
        self.0.ewma.lock().unwrap().observe(rtt, Instant::now());
        *self.0.failing_until.lock().unwrap() = None;
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

// === impl Balancer ===

struct Inner {
    rx: watch::Receiver<Resolution>,
    endpoints: Vec<Arc<EndpointHandle>>,
}

/// The endpoints of one service, kept in step with its discovery stream.
pub struct Balancer {
    inner: Mutex<Inner>,
    connector: Arc<Connector>,
}

impl Balancer {
    pub fn new(rx: watch::Receiver<Resolution>, connector: Arc<Connector>) -> Self {
        Self {
            inner: Mutex::new(Inner {
                rx,
                endpoints: Vec::new(),
            }),
            connector,
        }
    }

    pub fn watch(&self) -> watch::Receiver<Resolution> {
        self.inner.lock().unwrap().rx.clone()
    }

    /// The current endpoints, rebuilt if discovery changed. Handles of
    /// endpoints that stay keep their latency estimate and connections.
    pub fn endpoints(&self) -> Vec<Arc<EndpointHandle>> {
        let mut inner = self.inner.lock().unwrap();
        if inner.rx.has_changed().unwrap_or(false) {
            let resolved = inner.rx.borrow_and_update().endpoints.clone();
            let now = Instant::now();
            let seed = if inner.endpoints.is_empty() {
                DEFAULT_RTT.as_nanos() as f64
            } else {
                let sum: f64 = inner
                    .endpoints
                    .iter()
                    .map(|h| h.ewma.lock().unwrap().decayed(now))
                    .sum();
                sum / inner.endpoints.len() as f64
            };
            let mut old: BTreeMap<SocketAddr, Arc<EndpointHandle>> = inner
                .endpoints
                .drain(..)
                .map(|h| (h.endpoint.addr, h))
                .collect();
            inner.endpoints = resolved
                .values()
                .map(|ep| match old.remove(&ep.addr) {
                    Some(h) if h.endpoint == *ep => h,
                    _ => Arc::new(EndpointHandle::new(
                        ep.clone(),
                        self.connector.clone(),
                        seed,
                    )),
                })
                .collect();
        }
        inner.endpoints.clone()
    }
}

/// Picks the less loaded of two random endpoints, skipping `exclude` and,
/// while others remain, endpoints that are failing.
pub fn pick(
    endpoints: &[Arc<EndpointHandle>],
    exclude: &[SocketAddr],
) -> Option<Arc<EndpointHandle>> {
    let now = Instant::now();
    let candidates: Vec<&Arc<EndpointHandle>> = endpoints
        .iter()
        .filter(|h| !exclude.contains(&h.endpoint.addr))
        .collect();
    let healthy: Vec<&Arc<EndpointHandle>> = candidates
        .iter()
        .copied()
        .filter(|h| !h.failing_at(now))
        .collect();
    let pool = if healthy.is_empty() {
        candidates
    } else {
        healthy
    };
    match pool.len() {
        0 => None,
        1 => Some(pool[0].clone()),
        n => {
            let mut rng = rand::rng();
            let a = rng.random_range(0..n);
            let mut b = rng.random_range(0..n - 1);
            if b >= a {
                b += 1;
            }
            let (a, b) = (pool[a], pool[b]);
            let (la, lb) = (a.load(), b.load());
            // Within 1% is a tie; a and b are already in random order.
            Some(if la <= lb * 1.01 {
                a.clone()
            } else {
                b.clone()
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn handle(port: u16) -> Arc<EndpointHandle> {
        Arc::new(EndpointHandle::new(
            Endpoint {
                addr: SocketAddr::from(([127, 0, 0, 1], port)),
                weight: 1,
                identity: None,
                meshed: true,
                opaque: false,
                labels: BTreeMap::new(),
                authority_override: None,
            },
            Connector::plain(Duration::from_secs(1)),
            DEFAULT_RTT.as_nanos() as f64,
        ))
    }

    #[test]
    fn peak_ewma_jumps_up_and_decays_down() {
        let t0 = Instant::now();
        let mut e = PeakEwma {
            estimate_ns: 1e6,
            last: t0,
        };
        e.observe(Duration::from_millis(50), t0);
        assert_eq!(e.estimate_ns, 50e6);
        e.observe(Duration::from_millis(1), t0 + DECAY);
        assert!(
            e.estimate_ns < 50e6 * 0.4 && e.estimate_ns > 1e6,
            "{}",
            e.estimate_ns
        );
        // Unobserved, the estimate fades, so the endpoint is retried.
        let later = e.last + DECAY * 5;
        assert!(e.decayed(later) < e.estimate_ns * 0.01);
    }

    #[test]
    fn prefers_the_faster_endpoint() {
        let (fast, slow) = (handle(1), handle(2));
        fast.start().observe(Duration::from_millis(1));
        slow.start().observe(Duration::from_millis(50));
        let all = vec![fast.clone(), slow.clone()];
        let to_fast = (0..100)
            .filter(|_| pick(&all, &[]).unwrap().endpoint.addr.port() == 1)
            .count();
        assert_eq!(to_fast, 100);
    }

    #[test]
    fn a_new_endpoint_competes_with_fast_incumbents() {
        let (tx, rx) = watch::channel(Resolution::default());
        let balancer = Balancer::new(rx, Connector::plain(Duration::from_secs(1)));
        let ep = |port| handle(port).endpoint.clone();
        let set = |eps: Vec<Endpoint>| {
            tx.send_modify(|r| {
                r.endpoints = Arc::new(eps.into_iter().map(|e| (e.addr, e)).collect())
            });
        };
        set(vec![ep(1)]);
        let first = balancer.endpoints();
        first[0].start().observe(Duration::from_millis(1));
        set(vec![ep(1), ep(2)]);
        let both = balancer.endpoints();
        assert!(
            Arc::ptr_eq(&both[0], &first[0]),
            "the incumbent keeps its state"
        );
        let to_new = (0..200)
            .filter(|_| pick(&both, &[]).unwrap().endpoint.addr.port() == 2)
            .count();
        assert!(to_new > 50, "the new endpoint got {to_new} of 200 picks");
    }

    #[test]
    fn skips_failing_and_excluded() {
        let (a, b) = (handle(1), handle(2));
        a.mark_failed();
        let all = vec![a.clone(), b.clone()];
        for _ in 0..20 {
            assert_eq!(pick(&all, &[]).unwrap().endpoint.addr.port(), 2);
        }
        // When every endpoint is failing, one is still tried.
        assert_eq!(
            pick(&all, &[b.endpoint.addr]).unwrap().endpoint.addr.port(),
            1
        );
        assert!(pick(&all, &[a.endpoint.addr, b.endpoint.addr]).is_none());
    }
}
