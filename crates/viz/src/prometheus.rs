//! `tether stat --prometheus URL`: the same rows as from scraping the
//! proxies, computed by a Prometheus that scrapes them (with the labels of
//! the `file_sd` targets `tether up` writes, or of `docs/observability.md`'s
//! Kubernetes scrape configuration). Only `http://` URLs.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::Duration;

use crate::scrape;
use crate::stat::{GroupBy, Row, DEFAULT_ROUTE, FAILURE_CLASSES, LATENCY_BUCKET, REQUESTS};

#[derive(Debug, thiserror::Error)]
pub enum PrometheusError {
    #[error("--prometheus {url}: {reason}")]
    Url { url: String, reason: String },
    #[error(transparent)]
    Scrape(#[from] scrape::ScrapeError),
    #[error("Prometheus answered {status} to {query}: {body}")]
    Status {
        status: u16,
        query: String,
        body: String,
    },
    #[error("Prometheus answered {query} with something other than a vector: {reason}")]
    Answer { query: String, reason: String },
}

pub struct Prometheus {
    addr: SocketAddr,
    host: String,
    prefix: String,
}

impl Prometheus {
    /// Checks and resolves `url` (`http://host:port[/prefix]`).
    pub async fn connect(url: &str) -> Result<Self, PrometheusError> {
        let bad = |reason: &str| PrometheusError::Url {
            url: tether_core::truncate::for_log(url).to_string(),
            reason: reason.into(),
        };
        let rest = url
            .strip_prefix("http://")
            .ok_or_else(|| bad("only http:// URLs are supported"))?;
        let (host, prefix) = rest.split_once('/').unwrap_or((rest, ""));
        let host_port = if host.contains(':') {
            host.to_string()
        } else {
            format!("{host}:80")
        };
        let addr = tokio::net::lookup_host(&host_port)
            .await
            .map_err(|e| bad(&e.to_string()))?
            .next()
            .ok_or_else(|| bad("the host has no address"))?;
        Ok(Self {
            addr,
            host: host.to_string(),
            prefix: prefix.trim_end_matches('/').to_string(),
        })
    }

    /// An instant query: each series' labels and value.
    pub async fn query(
        &self,
        promql: &str,
    ) -> Result<Vec<(BTreeMap<String, String>, f64)>, PrometheusError> {
        let prefix = if self.prefix.is_empty() {
            String::new()
        } else {
            format!("/{}", self.prefix)
        };
        let path = format!("{prefix}/api/v1/query?query={}", percent_encode(promql));
        let (status, body) = scrape::get(self.addr, &self.host, &path).await?;
        let bounded = |s: &str| tether_core::truncate::bounded_message(s);
        if status != 200 {
            return Err(PrometheusError::Status {
                status,
                query: promql.to_string(),
                body: bounded(&body),
            });
        }
        let answer = |reason: String| PrometheusError::Answer {
            query: promql.to_string(),
            reason,
        };
        let json: serde_json::Value =
            serde_json::from_str(&body).map_err(|e| answer(e.to_string()))?;
        let result = json["data"]["result"]
            .as_array()
            .ok_or_else(|| answer(bounded(&body)))?;
        let mut series = Vec::new();
        for r in result {
            let labels = r["metric"]
                .as_object()
                .map(|m| {
                    m.iter()
                        .map(|(k, v)| (k.clone(), v.as_str().unwrap_or_default().to_string()))
                        .collect()
                })
                .unwrap_or_default();
            let value = r["value"][1]
                .as_str()
                .and_then(|v| v.parse::<f64>().ok())
                .ok_or_else(|| answer("a sample without a value".into()))?;
            series.push((labels, value));
        }
        Ok(series)
    }

    /// `tether stat`'s rows over the last `window`, computed by Prometheus.
    pub async fn stat(&self, by: GroupBy, window: Duration) -> Result<Vec<Row>, PrometheusError> {
        let (labels, direction) = match by {
            GroupBy::Service => ("authority", "outbound"),
            GroupBy::Workload => ("namespace, workload", "inbound"),
            GroupBy::Route => ("authority, route", "outbound"),
        };
        let w = format!("{}s", window.as_secs().max(1));
        let only = if by == GroupBy::Workload {
            ""
        } else {
            ",authority!=\"\""
        };
        let sel = format!("direction=\"{direction}\"{only}");
        let sum =
            |extra: &str| format!("sum by ({labels}) (increase({REQUESTS}{{{sel}{extra}}}[{w}]))");
        let failures = format!(",status_class=~\"{}\"", FAILURE_CLASSES.join("|"));
        let name = |l: &BTreeMap<String, String>| {
            let get = |k: &str| l.get(k).cloned().unwrap_or_default();
            match by {
                GroupBy::Service => get("authority"),
                GroupBy::Workload => format!("{}/{}", get("namespace"), get("workload")),
                GroupBy::Route => {
                    let route = Some(get("route")).filter(|r| !r.is_empty());
                    format!(
                        "{} {}",
                        get("authority"),
                        route.as_deref().unwrap_or(DEFAULT_ROUTE)
                    )
                }
            }
        };
        let by_name = |series: Vec<(BTreeMap<String, String>, f64)>| -> BTreeMap<String, f64> {
            let mut m = BTreeMap::new();
            for (l, v) in series {
                if v.is_finite() {
                    *m.entry(name(&l)).or_default() += v;
                }
            }
            m
        };
        let requests = by_name(self.query(&sum("")).await?);
        let failed = by_name(self.query(&sum(&failures)).await?);
        let tls = by_name(self.query(&sum(",tls=\"true\"")).await?);
        let mut quantiles = Vec::new();
        for q in [0.5, 0.95, 0.99] {
            let promql = format!(
                "histogram_quantile({q}, sum by ({labels}, le) (increase({LATENCY_BUCKET}{{{sel}}}[{w}])))"
            );
            quantiles.push(by_name(self.query(&promql).await?));
        }
        let secs = window.as_secs_f64().max(1.0);
        Ok(requests
            .into_iter()
            .map(|(name, n)| {
                let some = n > 0.0;
                // Each increase() extrapolates on its own: a part can come
                // out a little above the whole, a share never may.
                let f = failed.get(&name).copied().unwrap_or(0.0).min(n);
                let ms = |i: usize| quantiles[i].get(&name).map(|s| s * 1000.0);
                Row {
                    requests: n,
                    failures: f,
                    success_rate: some.then(|| 1.0 - f / n),
                    rps: n / secs,
                    p50_ms: ms(0),
                    p95_ms: ms(1),
                    p99_ms: ms(2),
                    mtls: some.then(|| (tls.get(&name).copied().unwrap_or(0.0) / n).min(1.0)),
                    name,
                }
            })
            .collect())
    }
}

/// Percent-encodes everything but RFC 3986's unreserved characters.
fn percent_encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len() * 3);
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn encodes_promql() {
        assert_eq!(
            super::percent_encode("sum by (a) (x{d=\"o\"}[5s])"),
            "sum%20by%20%28a%29%20%28x%7Bd%3D%22o%22%7D%5B5s%5D%29"
        );
    }
}
