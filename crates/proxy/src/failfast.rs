//! Fail-fast: limits how long a service may have no ready endpoint before
//! its requests are failed at once instead of waiting.
//!
//! One watcher per service follows its discovery state through three
//! states. *Ready*: the service has endpoints. *Waiting*: it has none, for
//! less than the fail-fast timeout; requests are held (in a bounded queue,
//! see the outbound service) in case an endpoint appears. *Fail-fast*: none
//! for the whole timeout; every request is answered at once with 503 /
//! UNAVAILABLE and `tether-proxy-error: service in fail-fast`. The first
//! endpoint to appear returns the service to *ready*. Each transition is
//! logged once, counted, and shown as a per-service gauge.

use std::time::Duration;

use tether_admin::Shutdown;
use tokio::sync::watch;
use tokio::time::Instant;

use crate::discovery::Resolution;
use crate::metrics::{AuthorityLabels, ProxyMetrics, TransitionLabels};

/// Starts the watcher; the receiver says whether the service is in
/// fail-fast. The watcher ends when `stop` fires.
pub fn spawn(
    authority: String,
    mut resolution: watch::Receiver<Resolution>,
    timeout: Duration,
    metrics: ProxyMetrics,
    stop: Shutdown,
) -> watch::Receiver<bool> {
    let (tx, rx) = watch::channel(false);
    tokio::spawn(async move {
        let gauge = metrics
            .failfast
            .get_or_create(&AuthorityLabels {
                authority: authority.clone(),
            })
            .clone();
        let transition = |to: &str| {
            metrics
                .failfast_transitions
                .get_or_create(&TransitionLabels {
                    authority: authority.clone(),
                    to: to.into(),
                })
                .inc();
        };
        let mut empty_since: Option<Instant> = None;
        loop {
            let has_endpoints = !resolution.borrow_and_update().endpoints.is_empty();
            if has_endpoints {
                empty_since = None;
                if tx.send_replace(false) {
                    tracing::info!(%authority, "service left fail-fast: an endpoint is ready");
                    transition("ready");
                    gauge.set(0);
                }
            } else if !*tx.borrow() {
                let deadline = *empty_since.get_or_insert_with(Instant::now) + timeout;
                tokio::select! {
                    changed = resolution.changed() => {
                        if changed.is_err() { return }
                        continue;
                    }
                    _ = tokio::time::sleep_until(deadline) => {
                        tx.send_replace(true);
                        tracing::warn!(%authority, ?timeout, "service entered fail-fast: no ready endpoint");
                        transition("failfast");
                        gauge.set(1);
                        continue;
                    }
                    _ = stop.triggered() => return,
                }
            }
            tokio::select! {
                changed = resolution.changed() => if changed.is_err() { return },
                _ = stop.triggered() => return,
            }
        }
    });
    rx
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::sync::Arc;

    use super::*;
    use crate::discovery::Endpoint;

    fn with_endpoint(on: bool) -> Resolution {
        let mut endpoints = BTreeMap::new();
        if on {
            let addr = "127.0.0.1:1".parse().unwrap();
            endpoints.insert(
                addr,
                Endpoint {
                    addr,
                    weight: 1,
                    identity: None,
                    meshed: false,
                    opaque: false,
                    labels: BTreeMap::new(),
                    authority_override: None,
                },
            );
        }
        Resolution {
            answered: true,
            exists: true,
            endpoints: Arc::new(endpoints),
            ..Default::default()
        }
    }

    /// Lets the watcher task run at the current (paused) instant.
    async fn settle() {
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
    }

    #[tokio::test(start_paused = true)]
    async fn ready_waiting_failfast_and_back() {
        let timeout = Duration::from_secs(3);
        let (tx, rx) = watch::channel(with_endpoint(true));
        let metrics = ProxyMetrics::default();
        let stop = Shutdown::default();
        let failfast = spawn("web:80".into(), rx, timeout, metrics.clone(), stop.clone());
        let transitions = |to: &str| {
            metrics
                .failfast_transitions
                .get_or_create(&TransitionLabels {
                    authority: "web:80".into(),
                    to: to.into(),
                })
                .get()
        };
        settle().await;
        assert!(!*failfast.borrow(), "ready");
        // No endpoint: waiting, not yet failing, until the whole timeout.
        tx.send_replace(with_endpoint(false));
        settle().await;
        tokio::time::advance(timeout - Duration::from_millis(10)).await;
        settle().await;
        assert!(!*failfast.borrow(), "still waiting");
        tokio::time::advance(Duration::from_millis(20)).await;
        settle().await;
        assert!(*failfast.borrow(), "fail-fast after the timeout");
        assert_eq!(transitions("failfast"), 1);
        // The first endpoint ends fail-fast at once.
        tx.send_replace(with_endpoint(true));
        settle().await;
        assert!(!*failfast.borrow());
        assert_eq!(transitions("ready"), 1);
        // Losing it again starts a fresh wait.
        tx.send_replace(with_endpoint(false));
        settle().await;
        tokio::time::advance(timeout / 2).await;
        settle().await;
        assert!(!*failfast.borrow());
        tokio::time::advance(timeout).await;
        settle().await;
        assert!(*failfast.borrow());
        assert_eq!(transitions("failfast"), 2);
        stop.trigger();
    }
}
