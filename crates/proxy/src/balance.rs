//! Load balancing: power of two choices over peak-EWMA latency, within
//! the best priority tier that has a healthy endpoint.
//!
//! Each endpoint keeps a latency estimate that jumps up at once to any
//! slower observation (the peak) and decays towards faster ones with time
//! constant `DECAY`. Its load is that estimate times (requests in flight +
//! 1), divided by its weight. A pick samples two endpoints at random and
//! takes the less loaded, which sends most traffic to fast endpoints while
//! still probing slow ones now and then.
//!
//! Tiers and health: discovery labels each endpoint with a tier
//! ([`tether_core::registry::TIER_LABEL`]; none means 0). A pick considers
//! only the best (lowest) tier that has an endpoint passive [`health`]
//! has not taken out, so a proxy fails over to a remote tier the moment
//! its local endpoints stop answering, before the registry notices. When
//! no endpoint of any tier is healthy (the panic threshold: zero healthy
//! endpoints), health and tiers are ignored and every endpoint is a
//! candidate: trying one that may have recovered beats failing for sure.
//!
//! A new endpoint starts at the mean estimate of the endpoints already
//! there (or a default when there are none): starting it slower would
//! starve it behind fast incumbents until its estimate decayed, starting it
//! at zero would flood it.
//!
//! [`health`]: crate::health

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use rand::Rng;
use tokio::sync::watch;

use crate::client::EndpointClient;
use crate::discovery::{Endpoint, Resolution};
use crate::health::{Ejection, Health};
use crate::http::Proto;
use crate::metrics::ReasonLabels;
use crate::tls::Connector;

const DECAY: Duration = Duration::from_secs(10);
/// The estimate an endpoint starts with, before any observation.
const DEFAULT_RTT: Duration = Duration::from_millis(30);

/// Endpoints taken out by passive health, by reason
/// (`tether_proxy_endpoint_ejections_total`).
pub type Ejections = Family<ReasonLabels, Counter>;

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
        let idle = nanos(now.saturating_duration_since(self.last));
        self.estimate_ns * exp_neg(idle / nanos(DECAY))
    }

    fn observe(&mut self, rtt: Duration, now: Instant) {
        let rtt = nanos(rtt);
        if rtt > self.estimate_ns {
            self.estimate_ns = rtt;
        } else {
            let elapsed = nanos(now.saturating_duration_since(self.last));
            let w = exp_neg(elapsed / nanos(DECAY));
            self.estimate_ns = self.estimate_ns * w + rtt * (1.0 - w);
        }
        self.last = now;
    }
}

/// `d` in nanoseconds. `Duration::as_nanos` is a u128, and its conversion
/// to f64 a call into compiler-rt (~80 instructions; three per request).
fn nanos(d: Duration) -> f64 {
    d.as_secs() as f64 * 1e9 + f64::from(d.subsec_nanos())
}

/// e^-x for x ≥ 0 (0 past 708, and for NaN), to 1e-14 of `f64::exp`,
/// computed here: `f64::exp` calls libm,
/// and this is the proxy's only per-request use of it; each call brought
/// ~0.3 MiB of libm's code and tables (the kernel's 64 KiB fault-around
/// windows) into every client proxy's resident set (docs/performance.md,
/// "A proxy-only binary").
fn exp_neg(x: f64) -> f64 {
    // Below the smallest normal f64 past this (e^-708 ≈ 3.3e-308).
    if x.is_nan() || x >= 708.0 {
        return 0.0;
    }
    // e^-x = 2^-k · e^-r with k = round(x / ln 2), |r| ≤ ln 2 / 2; ln 2 in
    // two parts so that r keeps its precision. `as` truncates, and x ≥ 0:
    // no call to libm's `round`.
    const LN2_HI: f64 = 6.931_471_803_691_238e-1;
    const LN2_LO: f64 = 1.908_214_929_270_587_7e-10;
    let k = (x * std::f64::consts::LOG2_E + 0.5) as u64;
    let r = (x - k as f64 * LN2_HI) - k as f64 * LN2_LO;
    // e^-r by its Taylor series to r^14/14!: the rest is < 1e-17 for |r| ≤ 0.35.
    // Multiplied by 1/n: fourteen divisions in a chain took ~200 cycles.
    const INVERSES: [f64; 14] = {
        let mut inverses = [0.0; 14];
        let mut n = 0;
        while n < 14 {
            inverses[n] = 1.0 / (n + 1) as f64;
            n += 1;
        }
        inverses
    };
    let mut sum = 1.0;
    for inverse in INVERSES.iter().rev() {
        sum = 1.0 - r * sum * inverse;
    }
    // 2^-k, k ≤ 1022: a normal f64 built from its exponent bits.
    sum * f64::from_bits((1023 - k) << 52)
}

// === impl EndpointHandle ===

pub struct EndpointHandle {
    pub endpoint: Endpoint,
    pub client: EndpointClient,
    /// The endpoint's priority tier (0 is the best).
    pub tier: u32,
    pub health: Health,
    ewma: Mutex<PeakEwma>,
    in_flight: AtomicUsize,
    ejections: Ejections,
}

/// An endpoint's tier as discovery labels it; unlabelled (or unreadable)
/// is tier 0, so a control plane that knows no tiers changes nothing.
fn tier_of(endpoint: &Endpoint) -> u32 {
    endpoint
        .labels
        .get(tether_core::registry::TIER_LABEL)
        .and_then(|t| t.parse().ok())
        .unwrap_or(0)
}

impl EndpointHandle {
    fn new(
        endpoint: Endpoint,
        connector: Arc<Connector>,
        estimate_ns: f64,
        ejections: Ejections,
    ) -> Self {
        Self {
            client: EndpointClient::new(endpoint.addr, endpoint.identity.clone(), connector),
            tier: tier_of(&endpoint),
            endpoint,
            health: Health::default(),
            ewma: Mutex::new(PeakEwma::new(estimate_ns)),
            in_flight: AtomicUsize::new(0),
            ejections,
        }
    }

    pub fn load(&self) -> f64 {
        let estimate = self.ewma.lock().unwrap().decayed(Instant::now());
        let pending = self.in_flight.load(Ordering::Relaxed) as f64;
        estimate * (pending + 1.0) / self.endpoint.weight as f64
    }

    /// Whether passive health has taken this endpoint out.
    pub fn is_failing(&self) -> bool {
        !self.health.available()
    }

    /// A connection to the endpoint could not be made: out at once.
    pub fn mark_failed(self: &Arc<Self>) {
        if let Some(why) = self.health.connect_failed() {
            self.ejected(why);
        }
    }

    /// A request failed before the app answered (see [`ACCRUAL`]).
    ///
    /// [`ACCRUAL`]: crate::health::ACCRUAL
    pub fn request_failed(self: &Arc<Self>) {
        if let Some(why) = self.health.request_failed() {
            self.ejected(why);
        }
    }

    /// Just taken out: count it, close its connections (requests in flight
    /// were told by [`Health`]), and probe it until it connects again.
    fn ejected(self: &Arc<Self>, why: Ejection) {
        tracing::debug!(addr = %self.endpoint.addr, reason = why.label(), "endpoint taken out of the balancer");
        self.ejections
            .get_or_create(&ReasonLabels {
                reason: why.label().into(),
            })
            .inc();
        self.client.close();
        // Outside a runtime (unit tests) nobody probes; the state still holds.
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let weak = Arc::downgrade(self);
        runtime.spawn(async move {
            loop {
                // Only a weak reference while waiting: a probe never keeps
                // alive an endpoint discovery dropped.
                let Some(pause) = weak.upgrade().map(|h| h.health.next_probe()) else {
                    return;
                };
                tokio::time::sleep(pause).await;
                let Some(handle) = weak.upgrade() else {
                    return;
                };
                // The connection a request would use (kept for it), bounded
                // by the connect timeout.
                let connected = if handle.endpoint.meshed {
                    handle.client.connection(Proto::Http2).await.is_ok()
                } else {
                    handle.client.connect_stream().await.is_ok()
                };
                if connected {
                    tracing::debug!(addr = %handle.endpoint.addr, "probe connected; endpoint back on probation");
                    handle.health.readmit();
                    return;
                }
            }
        });
    }

    /// Counts a request in flight until the guard drops.
    pub fn start(self: &Arc<Self>) -> InFlight {
        self.in_flight.fetch_add(1, Ordering::Relaxed);
        InFlight(self.clone())
    }
}

pub struct InFlight(Arc<EndpointHandle>);

impl InFlight {
    /// The app answered to a request sent at `sent`: a latency sample, and
    /// proof of health.
    pub fn observe(&self, sent: Instant) {
        // One clock read for both the sample and its time.
        let now = Instant::now();
        let rtt = now.saturating_duration_since(sent);
        self.0.ewma.lock().unwrap().observe(rtt, now);
        self.0.health.succeeded();
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

// === impl Balancer ===

/// A service's endpoints as one shared list: every request takes it, and
/// taking it copies nothing.
pub type Endpoints = Arc<[Arc<EndpointHandle>]>;

struct Inner {
    rx: watch::Receiver<Resolution>,
    endpoints: Endpoints,
}

/// The endpoints of one service, kept in step with its discovery stream.
pub struct Balancer {
    inner: Mutex<Inner>,
    connector: Arc<Connector>,
    ejections: Ejections,
}

impl Balancer {
    pub fn new(
        rx: watch::Receiver<Resolution>,
        connector: Arc<Connector>,
        ejections: Ejections,
    ) -> Self {
        Self {
            inner: Mutex::new(Inner {
                rx,
                endpoints: Arc::new([]),
            }),
            connector,
            ejections,
        }
    }

    pub fn watch(&self) -> watch::Receiver<Resolution> {
        self.inner.lock().unwrap().rx.clone()
    }

    /// The current endpoints, rebuilt if discovery changed. Handles of
    /// endpoints that stay keep their latency estimate and connections.
    pub fn endpoints(&self) -> Endpoints {
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
                .iter()
                .map(|h| (h.endpoint.addr, h.clone()))
                .collect();
            inner.endpoints = resolved
                .values()
                .map(|ep| match old.remove(&ep.addr) {
                    Some(h) if h.endpoint == *ep => h,
                    _ => Arc::new(EndpointHandle::new(
                        ep.clone(),
                        self.connector.clone(),
                        seed,
                        self.ejections.clone(),
                    )),
                })
                .collect();
        }
        inner.endpoints.clone()
    }
}

/// Picks the less loaded of two random endpoints among the healthy ones
/// of the best tier that has any, skipping `exclude`; when none is healthy
/// (panic), among all that are not excluded.
pub fn pick(
    endpoints: &[Arc<EndpointHandle>],
    exclude: &[SocketAddr],
) -> Option<Arc<EndpointHandle>> {
    // Two passes over the endpoints instead of collecting the pool: a pick
    // per request allocates nothing.
    let candidates = || {
        endpoints
            .iter()
            .filter(|h| !exclude.contains(&h.endpoint.addr))
    };
    let best_tier = candidates()
        .filter(|h| h.health.available())
        .map(|h| h.tier)
        .min();
    let in_pool = |h: &&Arc<EndpointHandle>| match best_tier {
        Some(best) => h.health.available() && h.tier == best,
        None => true,
    };
    let pool = || candidates().filter(in_pool);
    match pool().count() {
        0 => None,
        // Health may change between the passes (another worker thread):
        // then any candidate will do, as it would have a moment earlier.
        1 => pool().next().or_else(|| candidates().next()).cloned(),
        n => {
            let mut rng = rand::rng();
            let a = rng.random_range(0..n);
            let mut b = rng.random_range(0..n - 1);
            if b >= a {
                b += 1;
            }
            let (Some(a), Some(b)) = (pool().nth(a), pool().nth(b)) else {
                return candidates().next().cloned();
            };
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

    #[test]
    fn exp_neg_is_exp_of_minus_x() {
        let mut x = 0.0;
        while x < 708.0 {
            let (ours, libm) = (exp_neg(x), (-x).exp());
            assert!(
                (ours - libm).abs() <= libm * 1e-14,
                "e^-{x}: {ours} against {libm}"
            );
            x += 0.0137;
        }
        for x in [0.0, 1e-12, 0.5, 1.0, 10.0, 700.0] {
            assert!((exp_neg(x) - (-x).exp()).abs() <= (-x).exp() * 1e-14, "{x}");
        }
        assert_eq!(exp_neg(0.0), 1.0);
        assert_eq!(exp_neg(709.0), 0.0);
        assert_eq!(exp_neg(f64::INFINITY), 0.0);
        assert_eq!(exp_neg(f64::NAN), 0.0);
    }
    use std::collections::BTreeSet;

    fn handle(port: u16) -> Arc<EndpointHandle> {
        tiered(port, None)
    }

    fn tiered(port: u16, tier: Option<&str>) -> Arc<EndpointHandle> {
        let labels = tier
            .map(|t| (tether_core::registry::TIER_LABEL.to_string(), t.to_string()))
            .into_iter()
            .collect();
        Arc::new(EndpointHandle::new(
            Endpoint {
                addr: SocketAddr::from(([127, 0, 0, 1], port)),
                weight: 1,
                identity: None,
                meshed: true,
                opaque: false,
                labels,
                authority_override: None,
            },
            Connector::plain(Duration::from_secs(1)),
            DEFAULT_RTT.as_nanos() as f64,
            Ejections::default(),
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
        fast.start()
            .observe(Instant::now() - Duration::from_millis(1));
        slow.start()
            .observe(Instant::now() - Duration::from_millis(50));
        let all = vec![fast.clone(), slow.clone()];
        let to_fast = (0..100)
            .filter(|_| pick(&all, &[]).unwrap().endpoint.addr.port() == 1)
            .count();
        assert_eq!(to_fast, 100);
    }

    #[test]
    fn a_new_endpoint_competes_with_fast_incumbents() {
        let (tx, rx) = watch::channel(Resolution::default());
        let balancer = Balancer::new(
            rx,
            Connector::plain(Duration::from_secs(1)),
            Ejections::default(),
        );
        let ep = |port| handle(port).endpoint.clone();
        let set = |eps: Vec<Endpoint>| {
            tx.send_modify(|r| {
                r.endpoints = Arc::new(eps.into_iter().map(|e| (e.addr, e)).collect())
            });
        };
        set(vec![ep(1)]);
        let first = balancer.endpoints();
        first[0]
            .start()
            .observe(Instant::now() - Duration::from_millis(1));
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

    #[test]
    fn the_best_tier_with_a_healthy_endpoint_takes_every_request() {
        let (local_a, local_b) = (tiered(1, Some("0")), tiered(2, None));
        let (remote, far) = (tiered(3, Some("1")), tiered(4, Some("2")));
        let ejections = local_a.ejections.clone();
        // The remote is much faster: tiers still come first.
        remote
            .start()
            .observe(Instant::now() - Duration::from_micros(10));
        let all = vec![
            local_a.clone(),
            local_b.clone(),
            remote.clone(),
            far.clone(),
        ];
        let ports = |exclude: &[SocketAddr]| {
            (0..50)
                .map(|_| pick(&all, exclude).unwrap().endpoint.addr.port())
                .collect::<BTreeSet<u16>>()
        };
        assert_eq!(ports(&[]), BTreeSet::from([1, 2]));
        // Every local endpoint out: tier 1 at once, without discovery.
        local_a.mark_failed();
        local_b.mark_failed();
        assert_eq!(ports(&[]), BTreeSet::from([3]));
        assert_eq!(ports(&[remote.endpoint.addr]), BTreeSet::from([4]));
        // Nothing healthy at all (panic): everything not excluded is tried.
        for h in [&remote, &far] {
            h.mark_failed();
        }
        assert_eq!(ports(&[]), BTreeSet::from([1, 2, 3, 4]));
        assert_eq!(
            ejections
                .get_or_create(&ReasonLabels {
                    reason: "connect".into()
                })
                .get(),
            1,
            "each handle counts its own ejections (one family per service in use)"
        );
        // A local endpoint back on probation takes the traffic back.
        local_b.health.readmit();
        assert_eq!(ports(&[]), BTreeSet::from([2]));
    }
}
