//! Golden metrics — success rate, requests per second, latency percentiles
//! and the share of requests over mTLS — per service, workload or route,
//! over a window: the difference between two scrapes of the proxies'
//! counters (or, with a Prometheus, its `increase` over the window).
//!
//! A *service* is what clients asked for: outbound requests by authority,
//! summed over every proxy. A *workload* is one replica: the requests its
//! sidecar's inbound served. A *route* is a service's outbound requests by
//! the `route` label, where proxies export one.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::Serialize;
use tether_core::prom::{histogram_quantile, Sample};

pub const REQUESTS: &str = "tether_proxy_requests_total";
pub const LATENCY_BUCKET: &str = "tether_proxy_response_latency_seconds_bucket";
/// The request classes that count as failures (the rest succeeded).
pub const FAILURE_CLASSES: [&str; 3] = ["5xx", "grpc_error", "error"];
/// The route of requests no route matched, or from proxies without routes.
pub const DEFAULT_ROUTE: &str = "[default]";

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum GroupBy {
    Service,
    Workload,
    Route,
}

impl GroupBy {
    fn direction(self) -> &'static str {
        match self {
            GroupBy::Workload => "inbound",
            GroupBy::Service | GroupBy::Route => "outbound",
        }
    }

    /// The row a sample belongs to, if any.
    fn key(self, workload: &str, s: &Sample) -> Option<String> {
        if s.label("direction") != Some(self.direction()) {
            return None;
        }
        let authority = s.label("authority").filter(|a| !a.is_empty());
        match self {
            GroupBy::Service => authority.map(str::to_string),
            GroupBy::Workload => Some(workload.to_string()),
            GroupBy::Route => {
                let route = s.label("route").filter(|r| !r.is_empty());
                Some(format!("{} {}", authority?, route.unwrap_or(DEFAULT_ROUTE)))
            }
        }
    }
}

/// Cumulative counters of one row, from one scrape.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Counters {
    pub requests: f64,
    pub failures: f64,
    /// Requests whose hop between proxies was mTLS.
    pub tls: f64,
    /// Latency histogram: bucket upper bound (bits of the f64) → count.
    pub buckets: BTreeMap<u64, f64>,
}

pub type Totals = BTreeMap<String, Counters>;

/// One proxy's counters, grouped; `workload` names the proxy's replica.
pub fn totals(workload: &str, samples: &[Sample], by: GroupBy) -> Totals {
    let mut totals = Totals::new();
    for s in samples {
        let Some(key) = by.key(workload, s) else {
            continue;
        };
        match s.name.as_str() {
            REQUESTS => {
                let c = totals.entry(key).or_default();
                c.requests += s.value;
                if s.label("status_class")
                    .is_some_and(|c| FAILURE_CLASSES.contains(&c))
                {
                    c.failures += s.value;
                }
                if s.label("tls") == Some("true") {
                    c.tls += s.value;
                }
            }
            // A latency histogram without the route label cannot be split
            // by route: those rows get no percentiles rather than wrong ones.
            LATENCY_BUCKET if by != GroupBy::Route || s.label("route").is_some() => {
                let le = match s.label("le") {
                    Some("+Inf") | None => f64::INFINITY,
                    Some(v) => v.parse().unwrap_or(f64::INFINITY),
                };
                *totals
                    .entry(key)
                    .or_default()
                    .buckets
                    .entry(le.to_bits())
                    .or_default() += s.value;
            }
            _ => {}
        }
    }
    totals
}

/// What one proxy counted between two scrapes. A counter that went down
/// was reset (the proxy restarted): all it holds now is new.
pub fn delta(before: &Totals, after: &Totals) -> Totals {
    let diff = |a: f64, b: f64| if a >= b { a - b } else { a };
    after
        .iter()
        .map(|(key, a)| {
            let b = before.get(key).cloned().unwrap_or_default();
            let reset = a.requests < b.requests;
            let b = if reset { Counters::default() } else { b };
            let buckets = a
                .buckets
                .iter()
                .map(|(le, n)| (*le, diff(*n, b.buckets.get(le).copied().unwrap_or(0.0))))
                .collect();
            let c = Counters {
                requests: diff(a.requests, b.requests),
                failures: diff(a.failures, b.failures),
                tls: diff(a.tls, b.tls),
                buckets,
            };
            (key.clone(), c)
        })
        .collect()
}

/// Adds `other`'s counters into `into`.
pub fn merge(into: &mut Totals, other: Totals) {
    for (key, c) in other {
        let e = into.entry(key).or_default();
        e.requests += c.requests;
        e.failures += c.failures;
        e.tls += c.tls;
        for (le, n) in c.buckets {
            *e.buckets.entry(le).or_default() += n;
        }
    }
}

/// One line of `tether stat`.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Row {
    pub name: String,
    /// Requests completed in the window.
    pub requests: f64,
    pub failures: f64,
    /// 0..1; `None` with no request in the window.
    pub success_rate: Option<f64>,
    pub rps: f64,
    pub p50_ms: Option<f64>,
    pub p95_ms: Option<f64>,
    pub p99_ms: Option<f64>,
    /// Share of the window's requests whose hop was mTLS.
    pub mtls: Option<f64>,
}

/// The rows of counters gathered over `window`.
pub fn rows(window_totals: &Totals, window: Duration) -> Vec<Row> {
    let secs = window.as_secs_f64().max(1e-3);
    window_totals
        .iter()
        .map(|(name, c)| {
            let buckets: Vec<(f64, f64)> = c
                .buckets
                .iter()
                .map(|(le, n)| (f64::from_bits(*le), *n))
                .collect();
            let ms = |q| histogram_quantile(q, &buckets).map(|s| s * 1000.0);
            let some = c.requests > 0.0;
            Row {
                name: name.clone(),
                requests: c.requests,
                failures: c.failures,
                success_rate: some.then(|| 1.0 - c.failures / c.requests),
                rps: c.requests / secs,
                p50_ms: ms(0.5),
                p95_ms: ms(0.95),
                p99_ms: ms(0.99),
                mtls: some.then(|| c.tls / c.requests),
            }
        })
        .collect()
}

/// The rows as an aligned text table.
pub fn render(by: GroupBy, rows: &[Row]) -> String {
    let title = match by {
        GroupBy::Service => "SERVICE",
        GroupBy::Workload => "WORKLOAD",
        GroupBy::Route => "SERVICE ROUTE",
    };
    let width = rows
        .iter()
        .map(|r| r.name.len())
        .max()
        .unwrap_or(0)
        .max(title.len());
    let mut out = format!(
        "{title:<width$} {:>8} {:>9} {:>9} {:>9} {:>9} {:>5} {:>9}\n",
        "SUCCESS", "RPS", "P50", "P95", "P99", "MTLS", "REQUESTS"
    );
    let ms = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.1}ms"));
    let pct = |v: Option<f64>, digits: usize| {
        v.map_or("-".to_string(), |v| format!("{:.digits$}%", v * 100.0))
    };
    for r in rows {
        out.push_str(&format!(
            "{:<width$} {:>8} {:>9.1} {:>9} {:>9} {:>9} {:>5} {:>9}\n",
            r.name,
            pct(r.success_rate, 2),
            r.rps,
            ms(r.p50_ms),
            ms(r.p95_ms),
            ms(r.p99_ms),
            pct(r.mtls, 0),
            r.requests,
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use tether_core::prom::parse;

    const BEFORE: &str = r#"
tether_proxy_requests_total{direction="outbound",authority="web:80",status_class="2xx",tls="true",client_id=""} 10
tether_proxy_requests_total{direction="inbound",authority="web:80",status_class="2xx",tls="true",client_id="a"} 4
tether_proxy_response_latency_seconds_bucket{direction="outbound",authority="web:80",le="0.01"} 10
tether_proxy_response_latency_seconds_bucket{direction="outbound",authority="web:80",le="+Inf"} 10
"#;
    const AFTER: &str = r#"
tether_proxy_requests_total{direction="outbound",authority="web:80",status_class="2xx",tls="true",client_id=""} 100
tether_proxy_requests_total{direction="outbound",authority="web:80",status_class="5xx",tls="false",client_id=""} 10
tether_proxy_requests_total{direction="inbound",authority="web:80",status_class="2xx",tls="true",client_id="a"} 9
tether_proxy_response_latency_seconds_bucket{direction="outbound",authority="web:80",le="0.01"} 60
tether_proxy_response_latency_seconds_bucket{direction="outbound",authority="web:80",le="0.1"} 110
tether_proxy_response_latency_seconds_bucket{direction="outbound",authority="web:80",le="+Inf"} 110
"#;

    fn window(by: GroupBy) -> Vec<Row> {
        let b = totals("demo/web-0", &parse(BEFORE), by);
        let a = totals("demo/web-0", &parse(AFTER), by);
        rows(&delta(&b, &a), Duration::from_secs(10))
    }

    #[test]
    fn services_count_the_window_only() {
        let rows = window(GroupBy::Service);
        assert_eq!(rows.len(), 1);
        let r = &rows[0];
        assert_eq!(
            (r.name.as_str(), r.requests, r.failures),
            ("web:80", 100.0, 10.0)
        );
        assert_eq!(r.rps, 10.0);
        assert_eq!(r.success_rate, Some(0.9));
        assert_eq!(r.mtls, Some(0.9));
        // 50 of the window's 100 answered under 10 ms: the median is 10 ms.
        assert!((r.p50_ms.unwrap() - 10.0).abs() < 1e-6, "{r:?}");
    }

    #[test]
    fn workloads_count_inbound_and_routes_need_the_label() {
        let w = window(GroupBy::Workload);
        assert_eq!((w[0].name.as_str(), w[0].requests), ("demo/web-0", 5.0));
        let r = window(GroupBy::Route);
        assert_eq!(r[0].name, "web:80 [default]");
        assert_eq!(r[0].p50_ms, None);
    }

    #[test]
    fn a_restarted_proxy_counts_from_zero() {
        let b = totals("w", &parse(AFTER), GroupBy::Service);
        let a = totals("w", &parse(BEFORE), GroupBy::Service);
        assert_eq!(delta(&b, &a)["web:80"].requests, 10.0);
    }
}

/// A proxy to scrape: its workload name (`namespace/replica`) and admin address.
#[derive(Clone, Debug)]
pub struct Target {
    pub workload: String,
    pub admin: std::net::SocketAddr,
}

/// Scrapes every target, waits `window`, scrapes again: the rows of what
/// the proxies counted in between. A proxy unreachable at either scrape is
/// left out, with a warning naming it. `started` is called after the first
/// scrape, when the window opens.
pub async fn scrape_window(
    targets: &[Target],
    by: GroupBy,
    window: Duration,
    started: impl FnOnce(usize),
) -> Vec<Row> {
    let admins: Vec<_> = targets.iter().map(|t| t.admin).collect();
    let before = crate::scrape::metrics_all(&admins).await;
    started(before.iter().filter(|r| r.is_ok()).count());
    let opened = tokio::time::Instant::now();
    tokio::time::sleep(window).await;
    let after = crate::scrape::metrics_all(&admins).await;
    let elapsed = opened.elapsed();
    let mut sum = Totals::new();
    for ((t, b), a) in targets.iter().zip(before).zip(after) {
        match (b, a) {
            (Ok(b), Ok(a)) => merge(
                &mut sum,
                delta(&totals(&t.workload, &b, by), &totals(&t.workload, &a, by)),
            ),
            (Err(e), _) | (_, Err(e)) => {
                tracing::warn!(workload = %t.workload, error = %e, "proxy left out of the window")
            }
        }
    }
    rows(&sum, elapsed)
}
