//! An open-loop load generator. Requests are scheduled at a constant rate
//! and each latency is measured from the moment the request was *meant* to
//! be sent, so a stall on the server side shows up in the percentiles
//! instead of silently slowing the sender (coordinated omission). Without a
//! rate it runs closed-loop with fixed concurrency, to find the maximum
//! throughput. Every run is bounded in time and in concurrency.

use std::collections::BTreeMap;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use hdrhistogram::Histogram;
use http_body_util::{BodyExt, Empty};
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use serde::{Deserialize, Serialize};
use tether_admin::Shutdown;
use tokio::net::TcpStream;
use tokio::sync::Semaphore;

use crate::demo_grpc;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum LoadProtocol {
    #[default]
    Http1,
    Http2,
    Grpc,
}

impl std::str::FromStr for LoadProtocol {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "http1" => Ok(Self::Http1),
            "http2" => Ok(Self::Http2),
            "grpc" => Ok(Self::Grpc),
            _ => Err(format!(
                "unknown protocol {s:?}: expected http1, http2 or grpc"
            )),
        }
    }
}

#[derive(Clone, Debug)]
pub struct LoadSpec {
    /// Where connections go (an outbound proxy, or the app directly).
    pub connect: SocketAddr,
    /// The authority requests name.
    pub authority: String,
    pub path: String,
    pub protocol: LoadProtocol,
    /// Requests per second; `None` runs closed-loop at full speed.
    pub rate: Option<f64>,
    pub duration: Duration,
    /// Most requests in flight at once.
    pub concurrency: usize,
    /// Every request carries an `x-request-id` of its own, as requests of
    /// a traced app do (HTTP only).
    pub request_ids: bool,
}

impl LoadSpec {
    /// Refuses a rate that is not above 0 (an open loop that would never
    /// send).
    pub fn validate(&self) -> anyhow::Result<()> {
        if let Some(rate) = self.rate {
            anyhow::ensure!(rate > 0.0, "--rate must be above 0");
        }
        anyhow::ensure!(
            !(self.request_ids && self.protocol == LoadProtocol::Grpc),
            "--request-ids: HTTP only (--protocol http1 or http2)"
        );
        Ok(())
    }
}

/// What a run measured. Latencies are in microseconds.
#[derive(Clone)]
pub struct LoadReport {
    pub sent: u64,
    pub succeeded: u64,
    pub failed: u64,
    /// From the intended send time (open loop) or the send (closed loop).
    pub latency: Histogram<u64>,
    /// From the moment the request was actually sent: the server's share
    /// alone, without the sender's scheduling delay.
    pub service: Histogram<u64>,
    pub elapsed: Duration,
    pub errors: BTreeMap<String, u64>,
    pub replicas: BTreeMap<String, u64>,
    /// When (since the run started, by intended send time) the first and
    /// the last failed request were sent.
    pub failures_between: Option<(Duration, Duration)>,
}

impl Default for LoadReport {
    fn default() -> Self {
        Self {
            sent: 0,
            succeeded: 0,
            failed: 0,
            latency: Histogram::new_with_bounds(1, 120_000_000, 3).expect("valid bounds"),
            service: Histogram::new_with_bounds(1, 120_000_000, 3).expect("valid bounds"),
            elapsed: Duration::ZERO,
            errors: BTreeMap::new(),
            replicas: BTreeMap::new(),
            failures_between: None,
        }
    }
}

impl LoadReport {
    pub fn quantile_ms(&self, q: f64) -> f64 {
        if self.latency.is_empty() {
            return 0.0;
        }
        self.latency.value_at_quantile(q) as f64 / 1000.0
    }

    pub fn service_quantile_ms(&self, q: f64) -> f64 {
        if self.service.is_empty() {
            return 0.0;
        }
        self.service.value_at_quantile(q) as f64 / 1000.0
    }

    pub fn rps(&self) -> f64 {
        self.sent as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }

    pub fn merge(&mut self, other: &LoadReport) {
        self.sent += other.sent;
        self.succeeded += other.succeeded;
        self.failed += other.failed;
        let _ = self.latency.add(&other.latency);
        let _ = self.service.add(&other.service);
        self.elapsed = self.elapsed.max(other.elapsed);
        for (k, v) in &other.errors {
            *self.errors.entry(k.clone()).or_default() += v;
        }
        for (k, v) in &other.replicas {
            *self.replicas.entry(k.clone()).or_default() += v;
        }
        self.failures_between = match (self.failures_between, other.failures_between) {
            (Some((a, b)), Some((c, d))) => Some((a.min(c), b.max(d))),
            (x, None) | (None, x) => x,
        };
    }

    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "sent": self.sent,
            "succeeded": self.succeeded,
            "failed": self.failed,
            "rps": self.rps(),
            "p50_ms": self.quantile_ms(0.5),
            "p99_ms": self.quantile_ms(0.99),
            "p999_ms": self.quantile_ms(0.999),
            "max_ms": self.latency.max() as f64 / 1000.0,
            "service_p50_ms": self.service_quantile_ms(0.5),
            "service_p99_ms": self.service_quantile_ms(0.99),
            "service_p999_ms": self.service_quantile_ms(0.999),
            "elapsed_s": self.elapsed.as_secs_f64(),
            "errors": self.errors,
            "replicas": self.replicas,
            "first_failure_s": self.failures_between.map(|(a, _)| a.as_secs_f64()),
            "last_failure_s": self.failures_between.map(|(_, b)| b.as_secs_f64()),
        })
    }

    fn record(
        &mut self,
        outcome: Result<String, String>,
        latency: Duration,
        service: Duration,
        sent_at: Duration,
    ) {
        self.sent += 1;
        let _ = self.latency.record(latency.as_micros().max(1) as u64);
        let _ = self.service.record(service.as_micros().max(1) as u64);
        match outcome {
            Ok(replica) => {
                self.succeeded += 1;
                *self.replicas.entry(replica).or_default() += 1;
            }
            Err(e) => {
                self.failed += 1;
                *self.errors.entry(e).or_default() += 1;
                self.failures_between = Some(match self.failures_between {
                    Some((first, last)) => (first.min(sent_at), last.max(sent_at)),
                    None => (sent_at, sent_at),
                });
            }
        }
    }
}

/// Connects every request to one address, whatever the URI says.
#[derive(Clone)]
struct FixedConnector(SocketAddr);

impl tower_service::Service<http::Uri> for FixedConnector {
    type Response = TokioIo<TcpStream>;
    type Error = std::io::Error;
    type Future = Pin<Box<dyn Future<Output = std::io::Result<Self::Response>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, _: http::Uri) -> Self::Future {
        let addr = self.0;
        Box::pin(async move {
            let s = TcpStream::connect(addr).await?;
            s.set_nodelay(true)?;
            Ok(TokioIo::new(s))
        })
    }
}

#[derive(Clone)]
enum Caller {
    Http {
        client: Box<Client<FixedConnector, Empty<Bytes>>>,
        uri: http::Uri,
        /// With `--request-ids`: how many ids were given.
        ids: Option<Arc<AtomicU64>>,
    },
    Grpc(tonic::transport::Channel),
}

/// The `n`th request's id: UUID-shaped, different for every `n` below
/// 2^64 (an odd multiplier is a bijection on `u64`).
pub fn request_id(n: u64) -> http::HeaderValue {
    let x = n.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    http::HeaderValue::from_str(&format!(
        "{:08x}-{:04x}-4{:03x}-8{:03x}-{:012x}",
        x >> 32,
        (x >> 16) & 0xffff,
        (x >> 4) & 0xfff,
        x & 0xfff,
        x & 0xffff_ffff_ffff
    ))
    .expect("hex digits and dashes are a valid header value")
}

impl Caller {
    async fn new(spec: &LoadSpec) -> anyhow::Result<Self> {
        Ok(match spec.protocol {
            LoadProtocol::Grpc => {
                let origin: http::Uri = format!("http://{}", spec.authority).parse()?;
                let channel =
                    tonic::transport::Endpoint::from_shared(format!("http://{}", spec.connect))?
                        .origin(origin)
                        .connect_lazy();
                Caller::Grpc(channel)
            }
            proto => {
                let client = Client::builder(TokioExecutor::new())
                    .http2_only(proto == LoadProtocol::Http2)
                    .pool_max_idle_per_host(spec.concurrency)
                    .build(FixedConnector(spec.connect));
                Caller::Http {
                    client: Box::new(client),
                    uri: format!("http://{}{}", spec.authority, spec.path).parse()?,
                    ids: spec.request_ids.then(Arc::default),
                }
            }
        })
    }

    /// One request; the replica that answered, or the error.
    async fn call(&self) -> Result<String, String> {
        match self {
            Caller::Http { client, uri, ids } => {
                let mut req = http::Request::new(Empty::new());
                *req.uri_mut() = uri.clone();
                if let Some(ids) = ids {
                    let n = ids.fetch_add(1, Ordering::Relaxed);
                    req.headers_mut().insert("x-request-id", request_id(n));
                }
                let rsp = client
                    .request(req)
                    .await
                    .map_err(|e| format!("request failed: {e}"))?;
                let status = rsp.status();
                let replica = rsp
                    .headers()
                    .get(crate::demo_app::REPLICA_HEADER)
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or("")
                    .to_string();
                let proxy_error = rsp
                    .headers()
                    .get("tether-proxy-error")
                    .and_then(|v| v.to_str().ok())
                    .map(str::to_string);
                rsp.into_body()
                    .collect()
                    .await
                    .map_err(|e| format!("body failed: {e}"))?;
                match proxy_error {
                    Some(e) => Err(format!("{} ({e})", status.as_u16())),
                    None if status.is_server_error() => Err(format!("{}", status.as_u16())),
                    None => Ok(replica),
                }
            }
            Caller::Grpc(channel) => demo_grpc::hello(channel.clone(), "load")
                .await
                .map(|r| r.replica)
                .map_err(|s| format!("grpc {:?}: {}", s.code(), s.message())),
        }
    }
}

/// How long requests still in flight at the end of a run get to answer;
/// the rest are counted as failed ("unanswered"), so a hang cannot hide.
const ANSWER_GRACE: Duration = Duration::from_secs(30);

/// The error a request still unanswered after the grace is counted with.
pub const UNANSWERED: &str = "unanswered at the end of the run";

/// Requests sent and not yet answered: when each was meant to be sent.
/// Whoever removes an entry records the request, so it is counted once.
#[derive(Clone, Default)]
struct InFlight(Arc<Mutex<BTreeMap<u64, Instant>>>);

impl InFlight {
    fn start(&self, id: u64, intended: Instant) {
        self.0.lock().unwrap().insert(id, intended);
    }

    /// Whether the request was still waiting to be counted.
    fn finish(&self, id: u64) -> bool {
        self.0.lock().unwrap().remove(&id).is_some()
    }

    fn is_empty(&self) -> bool {
        self.0.lock().unwrap().is_empty()
    }

    fn take_all(&self) -> Vec<Instant> {
        std::mem::take(&mut *self.0.lock().unwrap())
            .into_values()
            .collect()
    }
}

/// Runs one load spec until its duration passes or `stop` fires.
pub async fn run(spec: LoadSpec, stop: Shutdown) -> anyhow::Result<LoadReport> {
    spec.validate()?;
    run_with_grace(spec, stop, ANSWER_GRACE).await
}

async fn run_with_grace(
    spec: LoadSpec,
    stop: Shutdown,
    grace: Duration,
) -> anyhow::Result<LoadReport> {
    let caller = Caller::new(&spec).await?;
    let report = Arc::new(Mutex::new(LoadReport::default()));
    let in_flight = InFlight::default();
    let concurrency = spec.concurrency.max(1);
    let permits = Arc::new(Semaphore::new(concurrency));
    let start = Instant::now();
    let end = start + spec.duration;
    let mut workers = Vec::new();
    match spec.rate {
        Some(rate) => {
            let interval = Duration::from_secs_f64(1.0 / rate.max(0.001));
            let mut i: u32 = 0;
            loop {
                let intended = start + interval * i;
                if intended >= end || stop.is_triggered() {
                    break;
                }
                tokio::select! {
                    _ = tokio::time::sleep_until(intended.into()) => {}
                    _ = stop.triggered() => break,
                }
                // Every permit held by a hung request must not hold the run
                // past its end.
                let permit = tokio::select! {
                    p = permits.clone().acquire_owned() => p?,
                    _ = tokio::time::sleep_until(end.into()) => break,
                    _ = stop.triggered() => break,
                };
                let (caller, report, in_flight) =
                    (caller.clone(), report.clone(), in_flight.clone());
                let id = u64::from(i);
                in_flight.start(id, intended);
                // Detached: one that answers after the grace is ignored.
                tokio::spawn(async move {
                    let sent = Instant::now();
                    let outcome = caller.call().await;
                    if in_flight.finish(id) {
                        report.lock().unwrap().record(
                            outcome,
                            intended.elapsed(),
                            sent.elapsed(),
                            intended.duration_since(start),
                        );
                    }
                    drop(permit);
                });
                i += 1;
            }
        }
        None => {
            let next_id = Arc::new(std::sync::atomic::AtomicU64::new(0));
            for _ in 0..concurrency {
                let (caller, report, stop, in_flight, next_id) = (
                    caller.clone(),
                    report.clone(),
                    stop.clone(),
                    in_flight.clone(),
                    next_id.clone(),
                );
                workers.push(tokio::spawn(async move {
                    while Instant::now() < end && !stop.is_triggered() {
                        let id = next_id.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        let t = Instant::now();
                        in_flight.start(id, t);
                        let outcome = caller.call().await;
                        let took = t.elapsed();
                        if in_flight.finish(id) {
                            report.lock().unwrap().record(
                                outcome,
                                took,
                                took,
                                t.duration_since(start),
                            );
                        }
                    }
                }));
            }
        }
    }
    // Requests still in flight get a bounded grace to answer.
    let answered = async {
        for w in &mut workers {
            let _ = w.await;
        }
        while !in_flight.is_empty() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    };
    let grace_over = async {
        tokio::select! {
            _ = tokio::time::sleep_until(end.into()) => {}
            _ = stop.triggered() => {}
        }
        tokio::time::sleep(grace).await;
    };
    tokio::select! {
        _ = answered => {}
        _ = grace_over => {}
    }
    for w in &workers {
        w.abort();
    }
    let mut out = report.lock().unwrap().clone();
    for intended in in_flight.take_all() {
        out.record(
            Err(UNANSWERED.to_string()),
            intended.elapsed(),
            intended.elapsed(),
            intended.duration_since(start),
        );
    }
    out.elapsed = start.elapsed();
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A server that accepts connections and never answers.
    async fn silent_server() -> SocketAddr {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((conn, _)) = listener.accept().await {
                held.push(conn);
            }
        });
        addr
    }

    #[tokio::test]
    async fn a_rate_not_above_zero_is_refused_before_connecting() {
        for rate in [0.0, -1.0, f64::NAN] {
            let spec = LoadSpec {
                connect: "127.0.0.1:9".parse().unwrap(),
                authority: "web".into(),
                path: "/".into(),
                protocol: LoadProtocol::Http1,
                rate: Some(rate),
                duration: Duration::from_secs(1),
                concurrency: 1,
                request_ids: false,
            };
            let err = run(spec, Shutdown::default()).await.err().unwrap();
            assert_eq!(err.to_string(), "--rate must be above 0");
        }
    }

    /// An HTTP/1.1 server that answers every request with an empty 200
    /// and keeps the `x-request-id` each one carried ("" for none).
    async fn id_recording_server() -> (SocketAddr, Arc<Mutex<Vec<String>>>) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let ids = seen.clone();
        tokio::spawn(async move {
            while let Ok((mut conn, _)) = listener.accept().await {
                let ids = ids.clone();
                tokio::spawn(async move {
                    let mut buf = Vec::new();
                    let mut chunk = [0; 4096];
                    while let Ok(n @ 1..) = conn.read(&mut chunk).await {
                        buf.extend_from_slice(&chunk[..n]);
                        while let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                            let head = String::from_utf8_lossy(&buf[..end]).to_lowercase();
                            let id = head
                                .lines()
                                .find_map(|l| l.strip_prefix("x-request-id: "))
                                .unwrap_or("")
                                .to_string();
                            ids.lock().unwrap().push(id);
                            buf.drain(..end + 4);
                            let ok = b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n";
                            if conn.write_all(ok).await.is_err() {
                                return;
                            }
                        }
                    }
                });
            }
        });
        (addr, seen)
    }

    #[tokio::test]
    async fn request_ids_differ_from_request_to_request() {
        for request_ids in [false, true] {
            let (connect, seen) = id_recording_server().await;
            let spec = LoadSpec {
                connect,
                authority: "web:80".into(),
                path: "/".into(),
                protocol: LoadProtocol::Http1,
                rate: None,
                duration: Duration::from_millis(200),
                concurrency: 4,
                request_ids,
            };
            let report = run(spec, Shutdown::default()).await.unwrap();
            let seen = seen.lock().unwrap().clone();
            assert!(report.succeeded > 10, "{request_ids}: {}", report.succeeded);
            assert_eq!(seen.len() as u64, report.sent, "{request_ids}");
            let distinct: std::collections::HashSet<&String> = seen.iter().collect();
            if request_ids {
                assert_eq!(distinct.len(), seen.len(), "an id given twice");
                assert!(seen.iter().all(|id| id.len() == 36), "{:?}", &seen[..2]);
            } else {
                assert_eq!(distinct.into_iter().collect::<Vec<_>>(), [&String::new()]);
            }
        }
        let grpc = LoadSpec {
            connect: "127.0.0.1:9".parse().unwrap(),
            authority: "web".into(),
            path: "/".into(),
            protocol: LoadProtocol::Grpc,
            rate: None,
            duration: Duration::from_secs(1),
            concurrency: 1,
            request_ids: true,
        };
        let err = run(grpc, Shutdown::default()).await.err().unwrap();
        assert!(err.to_string().contains("HTTP only"), "{err}");
    }

    #[tokio::test]
    async fn requests_unanswered_at_the_end_count_as_failed() {
        let connect = silent_server().await;
        for rate in [Some(50.0), None] {
            let spec = LoadSpec {
                connect,
                authority: "web:80".into(),
                path: "/".into(),
                protocol: LoadProtocol::Http1,
                rate,
                duration: Duration::from_millis(200),
                concurrency: 4,
                request_ids: false,
            };
            let report = run_with_grace(spec, Shutdown::default(), Duration::from_millis(100))
                .await
                .unwrap();
            assert!(report.sent > 0, "{rate:?}: nothing sent");
            assert_eq!(report.succeeded, 0, "{rate:?}");
            assert_eq!(report.failed, report.sent, "{rate:?}");
            assert_eq!(
                report.errors.get(UNANSWERED),
                Some(&report.sent),
                "{rate:?}"
            );
            assert!(report.failures_between.is_some(), "{rate:?}");
        }
    }
}
