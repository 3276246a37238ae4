//! `tether tap`: follows the tap API (`io.linkerd.proxy.tap.Tap/Observe`)
//! of one or more proxies and turns each request's events into one line.
//!
//! Authority, path prefix and method are matched by the proxies (only
//! matching requests leave them); the status is matched here, once the
//! response is known.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::net::SocketAddr;
use std::time::Duration;

use linkerd2_proxy_api::http_types::{self, HttpMethod};
use linkerd2_proxy_api::tap::observe_request::r#match::{self as m, Match as MatchKind};
use linkerd2_proxy_api::tap::observe_request::{self, extract};
use linkerd2_proxy_api::tap::tap_client::TapClient;
use linkerd2_proxy_api::tap::tap_event::{self, http as ev};
use linkerd2_proxy_api::tap::{ObserveRequest, TapEvent};
use serde::Serialize;
use tokio::sync::mpsc;

/// A proxy to tap.
#[derive(Clone, Debug)]
pub struct TapTarget {
    pub workload: String,
    pub addr: SocketAddr,
}

/// Which requests to show.
#[derive(Clone, Debug, Default)]
pub struct TapFilter {
    /// Exactly this authority (as the client wrote it, or normalized).
    pub authority: Option<String>,
    pub path_prefix: Option<String>,
    /// A method name; checked by [`TapFilter::method`].
    pub method: Option<String>,
    /// A status (`503`) or a class (`5xx`, `grpc_error`, `error`).
    pub status: Option<String>,
    /// Ask for the request headers (values only from the proxy's allow-list).
    pub headers: bool,
}

/// One request seen by one proxy.
#[derive(Clone, Debug, Serialize)]
pub struct TapLine {
    pub proxy: String,
    pub direction: String,
    pub method: String,
    pub authority: String,
    pub path: String,
    pub status: u32,
    /// `2xx`…`5xx`, `grpc_error` or `error`, once the response ended.
    pub class: String,
    pub latency_ms: f64,
    pub tls: bool,
    /// Inbound: the client's verified identity.
    pub client_id: Option<String>,
    /// Outbound: the identity the endpoint had to present.
    pub server_id: Option<String>,
    pub source: Option<String>,
    /// Outbound: the endpoint the request went to.
    pub destination: Option<String>,
    /// Outbound: the endpoint's labels from discovery (pod, zone, cluster).
    pub endpoint: BTreeMap<String, String>,
    pub route: Option<String>,
    pub headers: Vec<(String, String)>,
}

#[derive(Debug, thiserror::Error)]
pub enum TapError {
    #[error("tap {workload} at {addr}: {reason}")]
    Connect {
        workload: String,
        addr: SocketAddr,
        reason: String,
    },
    #[error("{0}")]
    Filter(String),
}

/// Requests whose response has not ended yet, per proxy; the oldest are
/// forgotten past this (a response that never ends must not grow memory).
const MAX_OPEN: usize = 10_000;

impl TapFilter {
    fn to_match(&self) -> Option<observe_request::Match> {
        let http = |m: m::http::Match| observe_request::Match {
            r#match: Some(MatchKind::Http(m::Http { r#match: Some(m) })),
        };
        let mut all = Vec::new();
        if let Some(a) = &self.authority {
            all.push(http(m::http::Match::Authority(m::http::StringMatch {
                r#match: Some(m::http::string_match::Match::Exact(a.clone())),
            })));
        }
        if let Some(p) = &self.path_prefix {
            all.push(http(m::http::Match::Path(m::http::StringMatch {
                r#match: Some(m::http::string_match::Match::Prefix(p.clone())),
            })));
        }
        if let Some(Ok(method)) = self.method() {
            all.push(http(m::http::Match::Method(HttpMethod::from(method))));
        }
        (!all.is_empty()).then_some(observe_request::Match {
            r#match: Some(MatchKind::All(m::Seq { matches: all })),
        })
    }

    /// The method filter, upper-cased; an error names a value that is no method.
    pub fn method(&self) -> Option<Result<http::Method, TapError>> {
        let m = self.method.as_ref()?;
        Some(
            http::Method::from_bytes(m.to_ascii_uppercase().as_bytes()).map_err(|_| {
                TapError::Filter(format!(
                    "--method {} is not an HTTP method",
                    tether_core::truncate::for_log(m)
                ))
            }),
        )
    }

    fn status_matches(&self, line: &TapLine) -> bool {
        match &self.status {
            None => true,
            Some(s) => *s == line.status.to_string() || s.eq_ignore_ascii_case(&line.class),
        }
    }
}

fn addr(a: &Option<linkerd2_proxy_api::net::TcpAddress>) -> Option<String> {
    let a = a.as_ref()?;
    let ip = std::net::IpAddr::try_from(a.ip?).ok()?;
    Some(SocketAddr::new(ip, u16::try_from(a.port).ok()?).to_string())
}

fn ms(d: &Option<prost_types::Duration>) -> f64 {
    d.as_ref().map_or(0.0, |d| {
        d.seconds as f64 * 1000.0 + f64::from(d.nanos) / 1e6
    })
}

struct Open {
    init: ev::RequestInit,
    status: u32,
}

/// Folds one proxy's events into lines.
struct Assembler {
    proxy: String,
    open: HashMap<u64, Open>,
    order: VecDeque<u64>,
}

impl Assembler {
    fn event(&mut self, e: TapEvent) -> Option<TapLine> {
        let Some(tap_event::Event::Http(http)) = &e.event else {
            return None;
        };
        match http.event.as_ref()? {
            ev::Event::RequestInit(init) => {
                let id = init.id?.stream;
                if self.open.len() >= MAX_OPEN {
                    if let Some(old) = self.order.pop_front() {
                        self.open.remove(&old);
                    }
                }
                self.order.push_back(id);
                self.open.insert(
                    id,
                    Open {
                        init: init.clone(),
                        status: 0,
                    },
                );
                None
            }
            ev::Event::ResponseInit(rsp) => {
                if let Some(o) = self.open.get_mut(&rsp.id?.stream) {
                    o.status = rsp.http_status;
                }
                None
            }
            ev::Event::ResponseEnd(end) => {
                let id = end.id?.stream;
                let open = self.open.remove(&id)?;
                self.order.retain(|i| *i != id);
                Some(self.line(&e, open, end))
            }
        }
    }

    fn line(&self, e: &TapEvent, open: Open, end: &ev::ResponseEnd) -> TapLine {
        let empty = HashMap::new();
        let src = e.source_meta.as_ref().map_or(&empty, |m| &m.labels);
        let dst = e.destination_meta.as_ref().map_or(&empty, |m| &m.labels);
        let route = e.route_meta.as_ref().map_or(&empty, |m| &m.labels);
        let inbound = e.proxy_direction == tap_event::ProxyDirection::Inbound as i32;
        let tls = if inbound {
            src.get("tls")
        } else {
            dst.get("tls")
        };
        let init = open.init;
        let method = init
            .method
            .and_then(|m| http::Method::try_from(m).ok())
            .map_or_else(|| "?".to_string(), |m| m.to_string());
        let headers = init
            .headers
            .map(|h: http_types::Headers| {
                h.headers
                    .into_iter()
                    .map(|h| (h.name, String::from_utf8_lossy(&h.value).into_owned()))
                    .collect()
            })
            .unwrap_or_default();
        let endpoint = if inbound {
            BTreeMap::new()
        } else {
            dst.iter()
                .filter(|(k, _)| !matches!(k.as_str(), "tls" | "server_id" | "authority"))
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect()
        };
        TapLine {
            proxy: self.proxy.clone(),
            direction: if inbound { "inbound" } else { "outbound" }.into(),
            method,
            authority: init.authority,
            path: init.path,
            status: open.status,
            class: route.get("status_class").cloned().unwrap_or_default(),
            latency_ms: ms(&end.since_request_init),
            tls: tls.map(String::as_str) == Some("true"),
            client_id: src.get("client_id").cloned(),
            server_id: dst.get("server_id").cloned(),
            source: addr(&e.source),
            destination: addr(&e.destination),
            endpoint,
            route: route.get("route").cloned(),
            headers,
        }
    }
}

/// Subscribes to one proxy and sends its lines (those the filter keeps)
/// to `lines` until the stream or the receiver ends. Returns once the
/// proxy accepted the subscription, with the task that follows it.
pub async fn observe(
    target: TapTarget,
    filter: TapFilter,
    lines: mpsc::Sender<TapLine>,
) -> Result<tokio::task::JoinHandle<()>, TapError> {
    if let Some(Err(e)) = filter.method() {
        return Err(e);
    }
    let fail = |reason: String| TapError::Connect {
        workload: target.workload.clone(),
        addr: target.addr,
        reason,
    };
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", target.addr))
        .map_err(|e| fail(e.to_string()))?
        .connect_timeout(Duration::from_secs(5))
        .connect()
        .await
        .map_err(|e| fail(e.to_string()))?;
    let request = ObserveRequest {
        limit: 0,
        r#match: filter.to_match(),
        extract: filter.headers.then_some(observe_request::Extract {
            extract: Some(extract::Extract::Http(extract::Http {
                extract: Some(extract::http::Extract::Headers(extract::http::Headers {})),
            })),
        }),
    };
    let mut stream = TapClient::new(channel)
        .observe(request)
        .await
        .map_err(|s| fail(format!("{}: {}", s.code(), s.message())))?
        .into_inner();
    let mut assembler = Assembler {
        proxy: target.workload.clone(),
        open: HashMap::new(),
        order: VecDeque::new(),
    };
    Ok(tokio::spawn(async move {
        loop {
            let event = tokio::select! {
                e = stream.message() => e,
                _ = lines.closed() => return,
            };
            match event {
                Ok(Some(e)) => {
                    if let Some(line) = assembler.event(e) {
                        if filter.status_matches(&line) && lines.send(line).await.is_err() {
                            return;
                        }
                    }
                }
                Ok(None) => return,
                Err(s) => {
                    tracing::warn!(proxy = %assembler.proxy, code = ?s.code(), message = %s.message(), "tap stream ended");
                    return;
                }
            }
        }
    }))
}

/// The line as text: one request, one line.
pub fn render(l: &TapLine) -> String {
    let mut out = format!(
        "{} {:<8} {} {}{} -> {} {} {:.1}ms tls={}",
        l.proxy, l.direction, l.method, l.authority, l.path, l.status, l.class, l.latency_ms, l.tls
    );
    let mut field = |k: &str, v: &Option<String>| {
        if let Some(v) = v {
            out.push_str(&format!(" {k}={v}"));
        }
    };
    field("client_id", &l.client_id);
    field("server_id", &l.server_id);
    field("src", &l.source);
    field("dst", &l.destination);
    field("route", &l.route);
    for (k, v) in &l.endpoint {
        out.push_str(&format!(" {k}={v}"));
    }
    for (k, v) in &l.headers {
        out.push_str(&format!(" {k}:{v:?}"));
    }
    out
}
