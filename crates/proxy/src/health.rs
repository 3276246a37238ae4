//! Passive health: endpoints taken out of the balancer by what requests
//! to them show, without waiting for discovery.
//!
//! A refused or failed connection takes an endpoint out at once (nothing
//! was sent, and the next connection would most likely fail the same way);
//! [`ACCRUAL`] consecutive failed requests (reset mid-request, or a peer
//! proxy answering that it could not reach its app) take it out too. An
//! endpoint that is out gets no requests while another endpoint is
//! available; a probe (a real connection, the same one a request would
//! use) tries it again after a backoff that doubles from [`FIRST_BACKOFF`]
//! to [`MAX_BACKOFF`], and readmits it on probation when it connects: its
//! next failed request takes it out again at once, its next success makes
//! it healthy and resets the backoff. Taking an endpoint out also closes
//! its connections and tells the requests in flight on it (see
//! [`Health::aborted`]), so retryable ones go elsewhere at once.

use std::sync::Mutex;
use std::time::Duration;

use tokio::sync::watch;

/// Consecutive failed requests that take an endpoint out.
pub const ACCRUAL: u32 = 3;
/// The first wait before an endpoint that is out is probed.
pub const FIRST_BACKOFF: Duration = Duration::from_millis(250);
/// The longest wait between probes.
pub const MAX_BACKOFF: Duration = Duration::from_secs(10);

/// Where an endpoint stands, as the `state` label of
/// `tether_proxy_endpoint_health` says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum State {
    Healthy,
    /// Out of the balancer until a probe connects.
    Ejected,
    /// Back after a probe connected; one failure takes it out again.
    Probation,
}

impl State {
    pub fn label(self) -> &'static str {
        match self {
            State::Healthy => "healthy",
            State::Ejected => "ejected",
            State::Probation => "probation",
        }
    }
}

/// Why an endpoint was taken out (the `reason` label of
/// `tether_proxy_endpoint_ejections_total`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ejection {
    Connect,
    Failures,
}

impl Ejection {
    pub fn label(self) -> &'static str {
        match self {
            Ejection::Connect => "connect",
            Ejection::Failures => "consecutive_failures",
        }
    }
}

#[derive(Debug)]
struct Inner {
    state: State,
    failures: u32,
    /// The wait before the next probe (doubles per failed probe).
    backoff: Duration,
}

/// One endpoint's passive health.
#[derive(Debug)]
pub struct Health {
    inner: Mutex<Inner>,
    /// Bumped whenever the endpoint is taken out (or dropped), so requests
    /// in flight on it stop waiting for an answer that may never come.
    abort: watch::Sender<u64>,
}

impl Default for Health {
    fn default() -> Self {
        Self {
            inner: Mutex::new(Inner {
                state: State::Healthy,
                failures: 0,
                backoff: FIRST_BACKOFF,
            }),
            abort: watch::Sender::new(0),
        }
    }
}

impl Health {
    pub fn state(&self) -> State {
        self.inner.lock().unwrap().state
    }

    /// Whether the balancer may pick the endpoint (outside panic).
    pub fn available(&self) -> bool {
        self.state() != State::Ejected
    }

    /// A request got its answer (from the app): the endpoint is healthy.
    pub fn succeeded(&self) {
        let mut inner = self.inner.lock().unwrap();
        inner.state = State::Healthy;
        inner.failures = 0;
        inner.backoff = FIRST_BACKOFF;
    }

    /// A connection could not be made. Returns `Some` when this took the
    /// endpoint out (it was not out already).
    pub fn connect_failed(&self) -> Option<Ejection> {
        self.eject(Ejection::Connect)
    }

    /// A request failed before the app answered. Returns `Some` when this
    /// took the endpoint out.
    pub fn request_failed(&self) -> Option<Ejection> {
        let failures = {
            let mut inner = self.inner.lock().unwrap();
            inner.failures += 1;
            if inner.state == State::Probation {
                ACCRUAL
            } else {
                inner.failures
            }
        };
        if failures >= ACCRUAL {
            self.eject(Ejection::Failures)
        } else {
            None
        }
    }

    fn eject(&self, why: Ejection) -> Option<Ejection> {
        {
            let mut inner = self.inner.lock().unwrap();
            if inner.state == State::Ejected {
                return None;
            }
            inner.state = State::Ejected;
        }
        self.abort_in_flight();
        Some(why)
    }

    /// Tells every request in flight on the endpoint to give up on it.
    pub fn abort_in_flight(&self) {
        self.abort.send_modify(|n| *n += 1);
    }

    /// Resolves when the endpoint is taken out or dropped after this call.
    pub fn aborted(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
        let mut rx = self.abort.subscribe();
        async move {
            // An error means the endpoint is gone: nobody can abort any more.
            if rx.changed().await.is_err() {
                std::future::pending::<()>().await;
            }
        }
    }

    /// How long to wait before the next probe, doubling the wait after it.
    pub fn next_probe(&self) -> Duration {
        let mut inner = self.inner.lock().unwrap();
        let pause = inner.backoff;
        inner.backoff = (inner.backoff * 2).min(MAX_BACKOFF);
        pause
    }

    /// A probe connected: back on probation.
    pub fn readmit(&self) {
        let mut inner = self.inner.lock().unwrap();
        if inner.state == State::Ejected {
            inner.state = State::Probation;
            inner.failures = 0;
        }
    }
}

const STATES: [State; 3] = [State::Healthy, State::Ejected, State::Probation];

/// Sets `tether_proxy_endpoint_health` for one authority's endpoints.
pub fn export_states(
    authority: &str,
    endpoints: &[std::sync::Arc<crate::balance::EndpointHandle>],
    metrics: &crate::metrics::ProxyMetrics,
) {
    for state in STATES {
        let count = endpoints
            .iter()
            .filter(|h| h.health.state() == state)
            .count();
        metrics
            .endpoint_health
            .get_or_create(&labels(authority, state))
            .set(count as i64);
    }
}

/// Removes an authority no longer followed from `tether_proxy_endpoint_health`.
pub fn forget_states(authority: &str, metrics: &crate::metrics::ProxyMetrics) {
    for state in STATES {
        metrics.endpoint_health.remove(&labels(authority, state));
    }
}

fn labels(authority: &str, state: State) -> crate::metrics::EndpointHealthLabels {
    crate::metrics::EndpointHealthLabels {
        authority: authority.to_string(),
        state: state.label().to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connect_failures_eject_at_once_request_failures_accrue() {
        let h = Health::default();
        assert_eq!(h.connect_failed(), Some(Ejection::Connect));
        assert!(!h.available());
        assert_eq!(h.connect_failed(), None, "already out");

        let h = Health::default();
        for _ in 1..ACCRUAL {
            assert_eq!(h.request_failed(), None);
            assert!(h.available());
        }
        h.succeeded();
        for _ in 1..ACCRUAL {
            assert_eq!(h.request_failed(), None, "a success resets the count");
        }
        assert_eq!(h.request_failed(), Some(Ejection::Failures));
        assert_eq!(h.state(), State::Ejected);
    }

    #[test]
    fn probation_ends_at_the_first_answer() {
        let h = Health::default();
        h.connect_failed();
        assert_eq!(h.next_probe(), FIRST_BACKOFF);
        assert_eq!(h.next_probe(), FIRST_BACKOFF * 2);
        h.readmit();
        assert_eq!(h.state(), State::Probation);
        assert!(h.available());
        assert_eq!(h.request_failed(), Some(Ejection::Failures));
        assert_eq!(
            h.next_probe(),
            FIRST_BACKOFF * 4,
            "the backoff keeps growing"
        );
        h.readmit();
        h.succeeded();
        assert_eq!(h.state(), State::Healthy);
        assert_eq!(h.next_probe(), FIRST_BACKOFF, "and resets on success");
        for _ in 0..20 {
            h.next_probe();
        }
        assert_eq!(h.next_probe(), MAX_BACKOFF);
    }

    #[tokio::test]
    async fn taking_an_endpoint_out_aborts_requests_in_flight() {
        let h = Health::default();
        let aborted = h.aborted();
        let waiting = tokio::spawn(aborted);
        tokio::task::yield_now().await;
        assert!(!waiting.is_finished());
        h.connect_failed();
        tokio::time::timeout(Duration::from_secs(5), waiting)
            .await
            .expect("the request in flight was told")
            .unwrap();
    }
}
