//! Live traffic from proxies' metrics: per-authority success rate, RPS and
//! latency percentiles over the interval between two scrapes.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper_util::rt::TokioIo;
use tether_core::prom::{self, histogram_quantile, Sample};

/// A plain HTTP/1.1 GET, for admin endpoints.
pub async fn http_get(addr: SocketAddr, path: &str) -> anyhow::Result<(u16, String)> {
    let fut = async {
        let stream = tokio::net::TcpStream::connect(addr).await?;
        let (mut sender, conn) =
            hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
        tokio::spawn(conn);
        let req = http::Request::get(path)
            .header(http::header::HOST, addr.to_string())
            .body(Empty::<Bytes>::new())?;
        let rsp = sender.send_request(req).await?;
        let status = rsp.status().as_u16();
        let body = rsp.into_body().collect().await?.to_bytes();
        Ok::<_, anyhow::Error>((status, String::from_utf8_lossy(&body).into_owned()))
    };
    tokio::time::timeout(Duration::from_secs(5), fut)
        .await
        .map_err(|_| anyhow::anyhow!("GET http://{addr}{path} timed out"))?
}

/// Cumulative per-authority counters from one scrape of several proxies.
#[derive(Clone, Debug, Default)]
pub struct Totals {
    pub by_authority: BTreeMap<String, AuthorityTotals>,
    /// Inbound requests per authority: (all, over mTLS).
    pub inbound_tls: BTreeMap<String, (f64, f64)>,
}

#[derive(Clone, Debug, Default)]
pub struct AuthorityTotals {
    pub requests: f64,
    pub failures: f64,
    /// Cumulative latency buckets: upper bound (seconds) → count.
    pub buckets: BTreeMap<u64, (f64, f64)>,
}

impl Totals {
    /// Counts inbound requests, and those that arrived over mTLS.
    pub fn add_inbound(&mut self, samples: &[Sample]) {
        for s in samples.iter().filter(|s| {
            s.name == "tether_proxy_requests_total" && s.label("direction") == Some("inbound")
        }) {
            let Some(authority) = s.label("authority") else {
                continue;
            };
            let e = self.inbound_tls.entry(authority.to_string()).or_default();
            e.0 += s.value;
            if s.label("tls") == Some("true") {
                e.1 += s.value;
            }
        }
    }

    /// Adds one proxy's samples for `direction`.
    pub fn add(&mut self, samples: &[Sample], direction: &str) {
        for s in samples
            .iter()
            .filter(|s| s.label("direction") == Some(direction))
        {
            let Some(authority) = s.label("authority") else {
                continue;
            };
            if authority.is_empty() {
                continue;
            }
            let t = self.by_authority.entry(authority.to_string()).or_default();
            match s.name.as_str() {
                "tether_proxy_requests_total" => {
                    t.requests += s.value;
                    if matches!(
                        s.label("status_class"),
                        Some("5xx" | "grpc_error" | "error")
                    ) {
                        t.failures += s.value;
                    }
                }
                "tether_proxy_response_latency_seconds_bucket" => {
                    let le = match s.label("le") {
                        Some("+Inf") => f64::INFINITY,
                        Some(v) => v.parse().unwrap_or(f64::INFINITY),
                        None => continue,
                    };
                    let e = t.buckets.entry(le.to_bits()).or_insert((le, 0.0));
                    e.1 += s.value;
                }
                _ => {}
            }
        }
    }
}

/// One row of the live view.
#[derive(Clone, Debug)]
pub struct Row {
    pub authority: String,
    pub rps: f64,
    pub success_rate: f64,
    pub p50_ms: Option<f64>,
    pub p99_ms: Option<f64>,
    /// Share of the interval's inbound requests that arrived over mTLS.
    pub mtls: Option<f64>,
}

/// Rates over `dt` between two scrapes.
pub fn rows(before: &Totals, after: &Totals, dt: Duration) -> Vec<Row> {
    let secs = dt.as_secs_f64().max(1e-3);
    after
        .by_authority
        .iter()
        .map(|(authority, a)| {
            let b = before
                .by_authority
                .get(authority)
                .cloned()
                .unwrap_or_default();
            let requests = (a.requests - b.requests).max(0.0);
            let failures = (a.failures - b.failures).max(0.0);
            let buckets: Vec<(f64, f64)> = a
                .buckets
                .values()
                .map(|(le, count)| {
                    let prev = b.buckets.get(&le.to_bits()).map_or(0.0, |p| p.1);
                    (*le, (count - prev).max(0.0))
                })
                .collect();
            let (all, tls) = after
                .inbound_tls
                .get(authority)
                .copied()
                .unwrap_or_default();
            let (all0, tls0) = before
                .inbound_tls
                .get(authority)
                .copied()
                .unwrap_or_default();
            let inbound = all - all0;
            Row {
                mtls: (inbound > 0.0).then(|| (tls - tls0) / inbound),
                authority: authority.clone(),
                rps: requests / secs,
                success_rate: if requests > 0.0 {
                    1.0 - failures / requests
                } else {
                    1.0
                },
                p50_ms: histogram_quantile(0.5, &buckets).map(|s| s * 1000.0),
                p99_ms: histogram_quantile(0.99, &buckets).map(|s| s * 1000.0),
            }
        })
        .collect()
}

/// Scrapes every admin address; unreachable ones are skipped.
pub async fn scrape(admins: &[SocketAddr]) -> Totals {
    let mut totals = Totals::default();
    for addr in admins {
        if let Ok((200, text)) = http_get(*addr, "/metrics").await {
            let samples = prom::parse(&text);
            totals.add(&samples, "outbound");
            totals.add_inbound(&samples);
        }
    }
    totals
}

pub fn render(rows: &[Row]) -> String {
    let mut out = format!(
        "{:<44} {:>8} {:>9} {:>9} {:>9} {:>6}\n",
        "SERVICE", "RPS", "SUCCESS", "P50", "P99", "MTLS"
    );
    let ms = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.1}ms"));
    for r in rows {
        out.push_str(&format!(
            "{:<44} {:>8.1} {:>8.2}% {:>9} {:>9} {:>6}\n",
            r.authority,
            r.rps,
            r.success_rate * 100.0,
            ms(r.p50_ms),
            ms(r.p99_ms),
            r.mtls
                .map_or("-".to_string(), |v| format!("{:.0}%", v * 100.0)),
        ));
    }
    out
}
