//! `tether dashboard`: a web page of the live mesh, served by Tether itself
//! (page, script and the vendored uPlot are compiled in: it works with no
//! internet).
//!
//! A sampler scrapes every process the mesh state file names once per
//! `interval` and publishes one JSON document (`/api/state`) through a
//! `watch`: topology edges (client workload → service, with RPS, success
//! and p99 over the last interval), per-service time series (at most
//! `history` points each), endpoints from the registry with fail-fast
//! state from the proxies, per global id the clusters, their tiers and
//! which one serves now (with the changes as failover events), and each
//! control-plane replica's health. The page polls that document.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use http::{Response, StatusCode};
use http_body_util::Full;
use hyper_util::rt::{TokioExecutor, TokioIo};
use serde::Serialize;
use serde_json::json;
use tether_admin::Shutdown;
use tether_core::prom::{histogram_quantile, Sample};
use tether_core::registry::{parse_documents, Document};
use tokio::sync::watch;

use crate::scrape;
use crate::stat::{self, GroupBy, Totals};
use crate::state::MeshState;

const INDEX_HTML: &str = include_str!("../assets/index.html");
const APP_JS: &str = include_str!("../assets/app.js");
const UPLOT_JS: &str = include_str!("../assets/uPlot.iife.min.js");
const UPLOT_CSS: &str = include_str!("../assets/uPlot.min.css");

/// Connections to the dashboard at once; more are closed at accept.
const MAX_CONNECTIONS: usize = 64;
const HEADER_TIMEOUT: Duration = Duration::from_secs(5);
const CONNECTION_LIFETIME: Duration = Duration::from_secs(60);
/// Failover events kept.
const MAX_EVENTS: usize = 50;
/// Registry files read per cluster, and bytes per file.
const MAX_REGISTRY_FILES: usize = 10_000;
const MAX_REGISTRY_FILE_BYTES: u64 = 1 << 20;

#[derive(Clone, Debug)]
pub struct DashboardConfig {
    pub listen: SocketAddr,
    pub state: PathBuf,
    /// Time between samples.
    pub interval: Duration,
    /// Points kept per time series.
    pub history: usize,
}

#[derive(Debug, thiserror::Error)]
pub enum DashboardError {
    #[error(transparent)]
    Bind(#[from] tether_admin::BindError),
}

/// One point of a service's golden metrics.
#[derive(Clone, Debug, Serialize)]
struct Point {
    /// Seconds since the epoch.
    t: f64,
    rps: f64,
    success: Option<f64>,
    p50_ms: Option<f64>,
    p99_ms: Option<f64>,
}

/// What the sampler remembers between samples.
#[derive(Default)]
struct Memory {
    /// Per proxy admin address: outbound totals by service, inbound totals.
    last: BTreeMap<SocketAddr, (Totals, Totals)>,
    last_at: Option<tokio::time::Instant>,
    series: BTreeMap<String, VecDeque<Point>>,
    /// Per global id: the clusters that served in the last interval.
    serving: BTreeMap<String, Vec<String>>,
    events: VecDeque<serde_json::Value>,
    samples: u64,
    /// Points kept per series.
    history: usize,
}

fn now_secs() -> f64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

fn sum(samples: &[Sample], name: &str, labels: &[(&str, &str)]) -> f64 {
    samples
        .iter()
        .filter(|s| s.name == name && labels.iter().all(|(k, v)| s.label(k) == Some(v)))
        .map(|s| s.value)
        .sum()
}

/// A registry directory's documents (files that do not parse are skipped:
/// the control plane reports those).
fn read_registry(dir: &Path) -> Vec<Document> {
    use std::io::Read;
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut docs = Vec::new();
    for e in entries.flatten().take(MAX_REGISTRY_FILES) {
        let path = e.path();
        let name = e.file_name().to_string_lossy().into_owned();
        if name.starts_with('.') || !(name.ends_with(".yaml") || name.ends_with(".yml")) {
            continue;
        }
        let mut text = String::new();
        let read = std::fs::File::open(&path)
            .and_then(|f| f.take(MAX_REGISTRY_FILE_BYTES).read_to_string(&mut text));
        if read.is_ok() {
            docs.extend(parse_documents(&text).unwrap_or_default());
        }
    }
    docs
}

impl Memory {
    /// One sample of the whole mesh, as the page's JSON.
    async fn sample(&mut self, state: &MeshState) -> serde_json::Value {
        let proxies: Vec<_> = state.proxies().collect();
        let admins: Vec<SocketAddr> = proxies.iter().map(|(_, p)| p.admin).collect();
        let controls: Vec<(String, SocketAddr)> = state
            .clusters
            .iter()
            .flat_map(|c| c.control_planes.iter().map(move |a| (c.name.clone(), *a)))
            .collect();
        let control_addrs: Vec<SocketAddr> = controls.iter().map(|(_, a)| *a).collect();
        let (scrapes, control_scrapes, control_ready) = tokio::join!(
            scrape::metrics_all(&admins),
            scrape::metrics_all(&control_addrs),
            futures::future::join_all(
                control_addrs
                    .iter()
                    .map(|a| async move { scrape::get(*a, &a.to_string(), "/ready").await })
            ),
        );
        let at = tokio::time::Instant::now();
        let dt = self
            .last_at
            .map_or(Duration::from_secs(1), |l| at.saturating_duration_since(l));
        self.last_at = Some(at);
        self.samples += 1;
        let t = now_secs();

        let mut edges = Vec::new();
        let mut services_now = Totals::new();
        let mut inbound_by_workload: BTreeMap<String, f64> = BTreeMap::new();
        let mut failfast: BTreeMap<String, bool> = BTreeMap::new();
        let mut proxies_json = Vec::new();
        let mut seen = BTreeSet::new();
        for ((cluster, p), scraped) in proxies.iter().zip(&scrapes) {
            seen.insert(p.admin);
            let workload = format!("{}/{}", p.namespace, p.workload);
            let Ok(samples) = scraped else {
                proxies_json.push(json!({"workload": workload, "cluster": cluster.name, "role": p.role, "up": false}));
                continue;
            };
            proxies_json.push(
                json!({"workload": workload, "cluster": cluster.name, "role": p.role, "up": true}),
            );
            for s in samples.iter().filter(|s| s.name == "tether_proxy_failfast") {
                if let Some(a) = s.label("authority") {
                    *failfast.entry(a.to_string()).or_default() |= s.value > 0.0;
                }
            }
            let out = stat::totals(&workload, samples, GroupBy::Service);
            let inb = stat::totals(&workload, samples, GroupBy::Workload);
            let (out_delta, in_delta) = match self.last.get(&p.admin) {
                Some((o, i)) => (stat::delta(o, &out), stat::delta(i, &inb)),
                // First sight of a proxy: nothing to compare with yet.
                None => (Totals::new(), Totals::new()),
            };
            self.last.insert(p.admin, (out, inb));
            for row in stat::rows(&out_delta, dt) {
                if row.requests > 0.0 {
                    edges.push(json!({
                        "from": workload,
                        "to": row.name,
                        "cluster": cluster.name,
                        "rps": row.rps,
                        "success": row.success_rate,
                        "p99_ms": row.p99_ms,
                    }));
                }
            }
            stat::merge(&mut services_now, out_delta);
            let served: f64 = in_delta.values().map(|c| c.requests).sum();
            *inbound_by_workload
                .entry(format!("{}/{}", cluster.name, p.workload))
                .or_default() += served;
        }
        self.last.retain(|a, _| seen.contains(a));

        let mut services = Vec::new();
        for row in stat::rows(&services_now, dt) {
            let series = self.series.entry(row.name.clone()).or_default();
            series.push_back(Point {
                t,
                rps: row.rps,
                success: row.success_rate,
                p50_ms: row.p50_ms,
                p99_ms: row.p99_ms,
            });
            services.push(json!({
                "name": row.name,
                "rps": row.rps,
                "success": row.success_rate,
                "p50_ms": row.p50_ms,
                "p99_ms": row.p99_ms,
                "mtls": row.mtls,
            }));
        }
        // A service with no request this interval still gets its point at 0.
        let live: BTreeSet<String> = services_now.keys().cloned().collect();
        for (name, series) in self.series.iter_mut() {
            if !live.contains(name) {
                series.push_back(Point {
                    t,
                    rps: 0.0,
                    success: None,
                    p50_ms: None,
                    p99_ms: None,
                });
            }
            while series.len() > self.history {
                series.pop_front();
            }
        }

        let (endpoints, globals) = self.registry_view(state, &inbound_by_workload, &failfast, t);
        let control = control_view(&controls, &control_scrapes, &control_ready);
        json!({
            "time": t,
            "samples": self.samples,
            "interval_s": dt.as_secs_f64(),
            "dashboard": state.dashboard,
            "proxies": proxies_json,
            "edges": edges,
            "services": services,
            "series": self.series,
            "endpoints": endpoints,
            "global": globals,
            "events": self.events,
            "control": control,
        })
    }

    /// Endpoints (readiness, zone, identity, fail-fast of their service)
    /// and per global id the clusters, tiers and which one serves now.
    fn registry_view(
        &mut self,
        state: &MeshState,
        inbound: &BTreeMap<String, f64>,
        failfast: &BTreeMap<String, bool>,
        t: f64,
    ) -> (Vec<serde_json::Value>, Vec<serde_json::Value>) {
        let mut endpoints = Vec::new();
        // global id → cluster → (services, requests served this interval)
        let mut globals: BTreeMap<String, BTreeMap<String, (Vec<String>, f64)>> = BTreeMap::new();
        for c in &state.clusters {
            let docs = read_registry(&c.registry);
            let mut global_of = BTreeMap::new();
            for d in &docs {
                if let Document::Service(s) = d {
                    if let Some(g) = &s.global_id {
                        global_of.insert((s.namespace.clone(), s.name.clone()), g.clone());
                    }
                }
            }
            for d in &docs {
                let (service, namespace, eps) = match d {
                    Document::Endpoints(e) => (&e.service, &e.namespace, &e.endpoints),
                    Document::Service(s) => (&s.name, &s.namespace, &s.endpoints),
                    _ => continue,
                };
                let authority_prefix =
                    format!("{service}.{namespace}.svc.{}:", state.cluster_domain);
                let in_failfast = failfast
                    .iter()
                    .any(|(a, on)| *on && a.starts_with(&authority_prefix));
                let global = global_of.get(&(namespace.clone(), service.clone()));
                for e in eps {
                    let served = e
                        .name
                        .as_ref()
                        .and_then(|n| inbound.get(&format!("{}/{n}", c.name)))
                        .copied()
                        .unwrap_or(0.0);
                    if let Some(g) = global {
                        let entry = globals
                            .entry(g.clone())
                            .or_default()
                            .entry(c.name.clone())
                            .or_default();
                        if !entry.0.contains(service) {
                            entry.0.push(service.clone());
                        }
                        entry.1 += served;
                    }
                    endpoints.push(json!({
                        "cluster": c.name,
                        "service": format!("{namespace}/{service}"),
                        "name": e.name,
                        "address": e.address.to_string(),
                        "ready": e.ready,
                        "zone": e.zone,
                        "identity": e.identity,
                        "failfast": in_failfast,
                    }));
                }
            }
        }
        let key = |e: &serde_json::Value| {
            ["cluster", "service", "name"].map(|k| e[k].as_str().unwrap_or_default().to_string())
        };
        endpoints.sort_by_key(key);
        let mut out = Vec::new();
        for (id, clusters) in globals {
            let serving: Vec<String> = clusters
                .iter()
                .filter(|(_, (_, served))| *served > 0.0)
                .map(|(c, _)| c.clone())
                .collect();
            let before = self.serving.insert(id.clone(), serving.clone());
            if before.as_ref().is_some_and(|b| *b != serving) {
                self.events.push_back(json!({
                    "time": t,
                    "global_id": id,
                    "from": before,
                    "to": serving,
                }));
                while self.events.len() > MAX_EVENTS {
                    self.events.pop_front();
                }
            }
            let rows: Vec<_> = clusters
                .iter()
                .map(|(cluster, (services, served))| {
                    json!({
                        "cluster": cluster,
                        "services": services,
                        "tiers": tiers(state, cluster),
                        "serving": *served > 0.0,
                        "rps_served": served,
                    })
                })
                .collect();
            out.push(json!({"global_id": id, "clusters": rows, "serving": serving}));
        }
        (endpoints, out)
    }
}

/// The tier at which each cluster reaches `cluster`: its own clients at 0,
/// a linked cluster at the link's priority.
fn tiers(state: &MeshState, cluster: &str) -> BTreeMap<String, u32> {
    let mut tiers = BTreeMap::new();
    for c in &state.clusters {
        if c.name == cluster {
            tiers.insert(c.name.clone(), 0);
        } else if let Some(l) = c.links.iter().find(|l| l.cluster == cluster) {
            tiers.insert(c.name.clone(), l.priority);
        }
    }
    tiers
}

fn control_view(
    controls: &[(String, SocketAddr)],
    scrapes: &[Result<Vec<Sample>, scrape::ScrapeError>],
    ready: &[Result<(u16, String), scrape::ScrapeError>],
) -> Vec<serde_json::Value> {
    let mut endpoints_per_cluster: BTreeMap<&str, BTreeSet<u64>> = BTreeMap::new();
    let mut rows = Vec::new();
    for (((cluster, addr), scraped), ready) in controls.iter().zip(scrapes).zip(ready) {
        let ready = matches!(ready, Ok((200, _)));
        let Ok(s) = scraped else {
            rows.push(
                json!({"cluster": cluster, "admin": addr.to_string(), "up": false, "ready": ready}),
            );
            continue;
        };
        let registry_endpoints = sum(s, "tether_registry_endpoints", &[]);
        endpoints_per_cluster
            .entry(cluster)
            .or_default()
            .insert(registry_endpoints.to_bits());
        let buckets: Vec<(f64, f64)> = s
            .iter()
            .filter(|x| x.name == "tether_destination_update_latency_seconds_bucket")
            .map(|x| {
                let le = x
                    .label("le")
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(f64::INFINITY);
                (le, x.value)
            })
            .collect();
        rows.push(json!({
            "cluster": cluster,
            "admin": addr.to_string(),
            "up": true,
            "ready": ready,
            "subscribers": sum(s, "tether_destination_subscribers", &[]),
            "registry_endpoints": registry_endpoints,
            "divergent": sum(s, "tether_destination_divergent_subscriptions", &[]),
            "audits": sum(s, "tether_destination_audits_total", &[]),
            "repairs": sum(s, "tether_destination_audit_repairs_total", &[]),
            "update_p99_ms": histogram_quantile(0.99, &buckets).map(|v| v * 1000.0),
        }));
    }
    for r in &mut rows {
        let cluster = r["cluster"].as_str().unwrap_or_default().to_string();
        let agree = endpoints_per_cluster
            .get(cluster.as_str())
            .is_none_or(|s| s.len() <= 1);
        r["replicas_agree"] = json!(agree);
    }
    rows
}

fn respond(path: &str, state: &watch::Receiver<Arc<String>>) -> Response<Full<Bytes>> {
    let (status, kind, body): (StatusCode, &str, Bytes) = match path {
        "/" | "/index.html" => (
            StatusCode::OK,
            "text/html; charset=utf-8",
            Bytes::from_static(INDEX_HTML.as_bytes()),
        ),
        "/app.js" => (
            StatusCode::OK,
            "text/javascript; charset=utf-8",
            Bytes::from_static(APP_JS.as_bytes()),
        ),
        "/uPlot.iife.min.js" => (
            StatusCode::OK,
            "text/javascript; charset=utf-8",
            Bytes::from_static(UPLOT_JS.as_bytes()),
        ),
        "/uPlot.min.css" => (
            StatusCode::OK,
            "text/css; charset=utf-8",
            Bytes::from_static(UPLOT_CSS.as_bytes()),
        ),
        "/api/state" => (
            StatusCode::OK,
            "application/json",
            Bytes::from(state.borrow().as_bytes().to_vec()),
        ),
        _ => (
            StatusCode::NOT_FOUND,
            "text/plain; charset=utf-8",
            Bytes::from_static(b"not found\n"),
        ),
    };
    Response::builder()
        .status(status)
        .header(http::header::CONTENT_TYPE, kind)
        .header(http::header::CACHE_CONTROL, "no-store")
        .body(Full::new(body))
        .expect("static parts")
}

/// Samples the mesh every `interval` into `tx` until shutdown.
async fn sample_loop(config: DashboardConfig, tx: watch::Sender<Arc<String>>, shutdown: Shutdown) {
    let mut memory = Memory {
        history: config.history.max(1),
        ..Memory::default()
    };
    let mut tick = tokio::time::interval(config.interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = shutdown.triggered() => return,
        }
        let doc = match MeshState::load(&config.state) {
            Ok(state) => memory.sample(&state).await,
            Err(e) => json!({"error": e.to_string(), "samples": memory.samples}),
        };
        tx.send_replace(Arc::new(doc.to_string()));
    }
}

/// Serves the dashboard until `shutdown`: binds (and announces
/// `listening dashboard ADDR`), samples and answers.
pub async fn run(config: DashboardConfig, shutdown: Shutdown) -> Result<(), DashboardError> {
    let listener = tether_admin::bind("dashboard", config.listen).await?;
    let (tx, rx) = watch::channel(Arc::new(json!({"samples": 0}).to_string()));
    tokio::spawn(sample_loop(config, tx, shutdown.clone()));
    let connections = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    loop {
        let (stream, _) = tokio::select! {
            a = tether_admin::accept(&listener, "dashboard") => a,
            _ = shutdown.triggered() => return Ok(()),
        };
        let Ok(permit) = connections.clone().try_acquire_owned() else {
            continue;
        };
        let rx = rx.clone();
        tokio::spawn(async move {
            let _permit = permit;
            let svc =
                hyper::service::service_fn(move |req: http::Request<hyper::body::Incoming>| {
                    let rsp = respond(req.uri().path(), &rx);
                    async move { Ok::<_, Infallible>(rsp) }
                });
            let mut builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
            builder
                .http1()
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(HEADER_TIMEOUT);
            let conn = builder.serve_connection(TokioIo::new(stream), svc);
            let _ = tokio::time::timeout(CONNECTION_LIFETIME, conn).await;
        });
    }
}
