//! Retries that make failover lossless, within a budget.
//!
//! Only idempotent requests are retried — GET, HEAD, OPTIONS, or any
//! request marked `tether-retryable: true` — and only when their body is
//! small enough to keep (empty, or a known length up to [`MAX_BODY`]). A
//! retry goes to another endpoint, after a connection error or an answer
//! the mesh itself gave (502/503 with `tether-proxy-error`, e.g. a remote
//! gateway in fail-fast): the app never saw those requests.
//!
//! The budget keeps retries from multiplying load in an outage: over the
//! last `ttl`, retries may not exceed `ratio` × requests plus a floor of
//! `min_per_second` × ttl. When it is spent, the failure is returned as is.

use std::collections::VecDeque;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use http::{HeaderMap, Method};

/// Largest request body kept for a possible retry.
pub const MAX_BODY: u64 = 64 * 1024;
/// Marks a request as safe to retry.
pub const RETRYABLE: &str = "tether-retryable";

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BudgetSpec {
    pub ratio: f64,
    pub min_per_second: f64,
    pub ttl: Duration,
}

impl Default for BudgetSpec {
    fn default() -> Self {
        Self {
            ratio: 0.2,
            min_per_second: 10.0,
            ttl: tether_core::registry::RETRY_BUDGET_WINDOW,
        }
    }
}

/// Per-second counts of requests and retries over the last `ttl`.
pub struct RetryBudget {
    spec: Mutex<BudgetSpec>,
    window: Mutex<VecDeque<(Instant, u32, u32)>>,
}

impl RetryBudget {
    pub fn new(spec: BudgetSpec) -> Self {
        Self {
            spec: Mutex::new(spec),
            window: Mutex::new(VecDeque::new()),
        }
    }

    pub fn set_spec(&self, spec: BudgetSpec) {
        *self.spec.lock().unwrap() = spec;
    }

    /// The window as of `now`: buckets older than `ttl` gone, the last one
    /// this second's.
    fn current(
        &self,
        now: Instant,
        ttl: Duration,
    ) -> std::sync::MutexGuard<'_, VecDeque<(Instant, u32, u32)>> {
        let mut w = self.window.lock().unwrap();
        // Instants compared, not subtracted: this runs for every request.
        if let Some(oldest) = now.checked_sub(ttl) {
            while w.front().is_some_and(|(t, _, _)| *t < oldest) {
                w.pop_front();
            }
        }
        if w.back()
            .is_none_or(|(t, _, _)| *t + Duration::from_secs(1) <= now)
        {
            w.push_back((now, 0, 0));
        }
        w
    }

    /// Counts a request.
    pub fn deposit(&self) {
        let ttl = self.spec.lock().unwrap().ttl;
        let mut w = self.current(Instant::now(), ttl);
        w.back_mut().expect("a bucket was just ensured").1 += 1;
    }

    /// Gives back a retry taken with [`Self::withdraw`] that was not sent
    /// after all (no endpoint left to send it to).
    pub fn refund(&self) {
        let mut w = self.window.lock().unwrap();
        if let Some(bucket) = w.iter_mut().rev().find(|(_, _, retries)| *retries > 0) {
            bucket.2 -= 1;
        }
    }

    /// Takes one retry from the budget, if there is one left.
    pub fn withdraw(&self) -> bool {
        let spec = *self.spec.lock().unwrap();
        let mut w = self.current(Instant::now(), spec.ttl);
        let (requests, retries) = w.iter().fold((0, 0), |(a, b), (_, r, t)| (a + r, b + t));
        let allowance =
            (spec.ratio * requests as f64 + spec.min_per_second * spec.ttl.as_secs_f64()) as u32;
        if retries >= allowance {
            return false;
        }
        w.back_mut().expect("a bucket was just ensured").2 += 1;
        true
    }
}

/// Whether a request may be retried, by method or by its marker header.
pub fn is_retryable(method: &Method, headers: &HeaderMap) -> bool {
    matches!(*method, Method::GET | Method::HEAD | Method::OPTIONS)
        || headers
            .get(RETRYABLE)
            .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"true"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_budget_is_a_ratio_plus_a_floor() {
        let budget = RetryBudget::new(BudgetSpec {
            ratio: 0.5,
            min_per_second: 0.2,
            ttl: Duration::from_secs(10),
        });
        // Floor: 0.2/s over 10 s = 2 retries with no traffic at all.
        assert!(budget.withdraw());
        assert!(budget.withdraw());
        assert!(!budget.withdraw());
        for _ in 0..10 {
            budget.deposit();
        }
        // 0.5 × 10 requests + 2 = 7 in all; 2 are spent.
        let granted = (0..10).filter(|_| budget.withdraw()).count();
        assert_eq!(granted, 5);
        // A retry that was not sent is given back, once.
        budget.refund();
        assert!(budget.withdraw());
        assert!(!budget.withdraw());
    }

    #[test]
    fn a_second_gets_its_own_bucket_and_buckets_age_out_after_the_ttl() {
        let ttl = Duration::from_secs(10);
        let budget = RetryBudget::new(BudgetSpec {
            ratio: 0.5,
            min_per_second: 0.0,
            ttl,
        });
        let start = Instant::now();
        let at = |secs_ms: u64| start + Duration::from_millis(secs_ms);
        budget.current(at(0), ttl).back_mut().unwrap().1 += 1;
        budget.current(at(999), ttl).back_mut().unwrap().1 += 1;
        assert_eq!(
            budget.current(at(999), ttl).len(),
            1,
            "one second, one bucket"
        );
        assert_eq!(budget.current(at(1_000), ttl).len(), 2);
        // The first bucket lives its ttl; the tenth second has its own.
        assert_eq!(budget.current(at(10_000), ttl).len(), 3);
        let w = budget.current(at(10_001), ttl);
        assert_eq!(w.len(), 2, "the first bucket aged out");
        assert_eq!((w[0].0, w[0].1), (at(1_000), 0));
    }

    #[test]
    fn idempotent_or_marked() {
        let mut h = HeaderMap::new();
        assert!(is_retryable(&Method::GET, &h));
        assert!(!is_retryable(&Method::POST, &h));
        h.insert(RETRYABLE, "true".parse().unwrap());
        assert!(is_retryable(&Method::POST, &h));
    }
}
