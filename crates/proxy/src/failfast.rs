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
