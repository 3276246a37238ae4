//! The tap API: a live stream of the requests this proxy handles, served as
//! Linkerd's `io.linkerd.proxy.tap.Tap/Observe` (from `linkerd2-proxy-api`),
//! so `tether tap` and Linkerd's tooling can both read it.
//!
//! What a tap may see is bounded: never bodies; the path without its query;
//! header values only for names on the allow-list (other names are listed
//! with the value `[redacted]`), at most [`MAX_HEADERS`] of them. Who may tap
//! is bounded too: peers on loopback, or — over mTLS — identities the
//! operator allowed. And tapping never slows the data path: with no
//! observer a request costs one atomic load; with observers, events go
//! through a bounded channel per observer and are dropped (and counted in
//! `tether_proxy_tap_dropped_events_total`) when it is full.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use http::header::HeaderName;
use linkerd2_proxy_api::http_types::{self, HttpMethod, Scheme};
use linkerd2_proxy_api::net::TcpAddress;
use linkerd2_proxy_api::tap::observe_request::r#match::{self as m, Match as MatchKind};
use linkerd2_proxy_api::tap::tap_event::{self, http as ev};
use linkerd2_proxy_api::tap::tap_server::{Tap as TapApi, TapServer};
use linkerd2_proxy_api::tap::{observe_request, ObserveRequest, TapEvent};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tether_admin::Shutdown;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpListener;
use tokio::sync::mpsc;

use crate::metrics::Hop;
use crate::tls::BoxedIo;

/// Header names whose values a tap shows unless the operator says otherwise.
pub const DEFAULT_HEADERS: [&str; 3] = ["content-type", "user-agent", "grpc-status"];
/// What a header value outside the allow-list is replaced by.
pub const REDACTED: &str = "[redacted]";
/// Headers listed per request; more are left out.
pub const MAX_HEADERS: usize = 32;
/// Bytes of a header value or a path shown; longer ones are cut.
pub const MAX_VALUE_BYTES: usize = 256;
pub const MAX_PATH_BYTES: usize = 1024;
/// Observers at once; more are refused with RESOURCE_EXHAUSTED.
pub const MAX_OBSERVERS: usize = 16;
/// Events buffered per observer; past it events are dropped.
pub const OBSERVER_BUFFER: usize = 256;

/// Who may tap besides loopback peers, and which header values it shows.
#[derive(Clone, Debug)]
pub struct TapConfig {
    pub listen: SocketAddr,
    /// Identities allowed to tap over mTLS (peers elsewhere than loopback).
    pub allowed_identities: Vec<String>,
    /// Header names (lowercase) whose values are shown.
    pub headers: Vec<String>,
}

type Events = mpsc::Sender<Result<TapEvent, tonic::Status>>;

struct Observer {
    filter: Option<observe_request::Match>,
    headers: bool,
    /// Requests still to report; `None`: no limit.
    remaining: Option<u32>,
    events: Events,
}

struct Inner {
    /// Observers registered: zero means nothing to do for a request.
    active: AtomicUsize,
    observers: Mutex<Vec<Observer>>,
    next_id: AtomicU64,
    allowed_headers: RwLock<Arc<HashSet<HeaderName>>>,
    dropped: Counter,
    observers_gauge: Gauge,
}

/// The proxy's tap: requests are offered to it; observers subscribe
/// through the tap API.
#[derive(Clone)]
pub struct Tap {
    inner: Arc<Inner>,
}

impl Default for Tap {
    fn default() -> Self {
        let tap = Self {
            inner: Arc::new(Inner {
                active: AtomicUsize::new(0),
                observers: Mutex::new(Vec::new()),
                next_id: AtomicU64::new(0),
                allowed_headers: RwLock::new(Arc::default()),
                dropped: Counter::default(),
                observers_gauge: Gauge::default(),
            }),
        };
        tap.allow_headers(DEFAULT_HEADERS.iter().map(|h| h.to_string()));
        tap
    }
}

/// A tapped request: what was known when it came in.
pub struct TapRequest {
    id: u64,
    started: Instant,
    method: http::Method,
    scheme: Option<http::uri::Scheme>,
    authority: String,
    path: String,
    headers: Vec<(String, Vec<u8>)>,
}

/// The observers a request matched, waiting for its end.
pub struct TapEnd {
    base: TapEvent,
    id: ev::StreamId,
    started: Instant,
    responded: Instant,
    observers: Vec<Events>,
    tap: Tap,
}

/// What a match is evaluated against, once the response is known.
struct Facts<'a> {
    req: &'a TapRequest,
    authority: &'a str,
    source: Option<SocketAddr>,
    destination: Option<SocketAddr>,
    destination_labels: &'a BTreeMap<String, String>,
    route_labels: &'a BTreeMap<String, String>,
}

fn cut(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_string();
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &s[..end])
}

fn tcp(addr: SocketAddr) -> TcpAddress {
    TcpAddress {
        ip: Some(addr.ip().into()),
        port: addr.port().into(),
    }
}

fn duration(d: Duration) -> prost_types::Duration {
    prost_types::Duration {
        seconds: i64::try_from(d.as_secs()).unwrap_or(i64::MAX),
        nanos: i32::try_from(d.subsec_nanos()).unwrap_or(0),
    }
}

impl Tap {
    /// Replaces the header allow-list.
    pub fn allow_headers(&self, names: impl IntoIterator<Item = String>) {
        let set = names
            .into_iter()
            .filter_map(|n| HeaderName::from_bytes(n.to_ascii_lowercase().as_bytes()).ok())
            .collect();
        *self
            .inner
            .allowed_headers
            .write()
            .unwrap_or_else(|e| e.into_inner()) = Arc::new(set);
    }

    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "tether_proxy_tap_dropped_events",
            "Tap events dropped because an observer's buffer was full (tapping never waits)",
            self.inner.dropped.clone(),
        );
        registry.register(
            "tether_proxy_tap_observers",
            "Tap observers connected",
            self.inner.observers_gauge.clone(),
        );
    }

    /// Captures a request if anyone is tapping (one atomic load otherwise).
    pub fn request<B>(&self, req: &http::Request<B>) -> Option<TapRequest> {
        if self.inner.active.load(Ordering::Relaxed) == 0 {
            return None;
        }
        let allowed = self
            .inner
            .allowed_headers
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        let headers = req
            .headers()
            .iter()
            .take(MAX_HEADERS)
            .map(|(name, value)| {
                let shown = if allowed.contains(name) {
                    cut(&String::from_utf8_lossy(value.as_bytes()), MAX_VALUE_BYTES).into_bytes()
                } else {
                    REDACTED.as_bytes().to_vec()
                };
                (name.as_str().to_string(), shown)
            })
            .collect();
        let authority = req
            .uri()
            .authority()
            .map(|a| a.as_str().to_string())
            .or_else(|| {
                req.headers()
                    .get(http::header::HOST)
                    .and_then(|h| h.to_str().ok())
                    .map(str::to_string)
            })
            .unwrap_or_default();
        Some(TapRequest {
            id: self.inner.next_id.fetch_add(1, Ordering::Relaxed),
            started: Instant::now(),
            method: req.method().clone(),
            scheme: req.uri().scheme().cloned(),
            authority: cut(&authority, MAX_VALUE_BYTES),
            path: cut(req.uri().path(), MAX_PATH_BYTES),
            headers,
        })
    }

    fn send(&self, events: &Events, event: TapEvent) {
        if events.try_send(Ok(event)).is_err() {
            self.inner.dropped.inc();
        }
    }

    fn subscribe(
        &self,
        req: ObserveRequest,
    ) -> Result<mpsc::Receiver<Result<TapEvent, tonic::Status>>, tonic::Status> {
        let mut observers = self
            .inner
            .observers
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        observers.retain(|o| !o.events.is_closed());
        if observers.len() >= MAX_OBSERVERS {
            return Err(tonic::Status::resource_exhausted(format!(
                "at most {MAX_OBSERVERS} tap observers at once"
            )));
        }
        let (tx, rx) = mpsc::channel(OBSERVER_BUFFER);
        observers.push(Observer {
            filter: req.r#match,
            headers: req.extract.is_some(),
            remaining: (req.limit > 0).then_some(req.limit),
            events: tx,
        });
        self.update_counts(observers.len());
        Ok(rx)
    }

    fn update_counts(&self, n: usize) {
        self.inner.active.store(n, Ordering::Relaxed);
        self.inner
            .observers_gauge
            .set(i64::try_from(n).unwrap_or(i64::MAX));
    }
}

impl TapRequest {
    /// The response headers are here: reports the request to every observer
    /// whose match it meets, and returns them for the response's end.
    pub fn respond(
        self,
        tap: &Tap,
        direction: &str,
        authority: &str,
        status: http::StatusCode,
        hop: &Hop,
    ) -> Option<TapEnd> {
        let responded = Instant::now();
        let endpoint = hop.endpoint.as_ref().map(|e| &e.endpoint);
        let (source, destination) = match direction {
            "inbound" => (hop.peer, None),
            _ => (None, endpoint.map(|e| e.addr)),
        };
        let empty = BTreeMap::new();
        let destination_labels = endpoint.map_or(&empty, |e| &e.labels);
        // Routes are not labelled yet: route matches see no labels.
        let route_labels = BTreeMap::new();
        let facts = Facts {
            req: &self,
            authority,
            source,
            destination,
            destination_labels,
            route_labels: &route_labels,
        };
        let mut matched = Vec::new();
        {
            let mut observers = tap
                .inner
                .observers
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            for o in observers.iter_mut() {
                if o.events.is_closed() || !matches(o.filter.as_ref(), &facts) {
                    continue;
                }
                if let Some(n) = &mut o.remaining {
                    *n -= 1;
                }
                matched.push((o.events.clone(), o.headers));
            }
            // An observer past its limit is dropped: its stream then ends.
            observers.retain(|o| o.remaining != Some(0) && !o.events.is_closed());
            tap.update_counts(observers.len());
        }
        if matched.is_empty() {
            return None;
        }
        let mut source_labels = HashMap::new();
        source_labels.insert("tls".to_string(), hop.tls.to_string());
        if let Some(id) = &hop.client_id {
            source_labels.insert("client_id".to_string(), id.to_string());
        }
        let mut dest_labels: HashMap<String, String> = destination_labels
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        dest_labels.insert("authority".to_string(), authority.to_string());
        dest_labels.insert("tls".to_string(), hop.tls.to_string());
        if let Some(id) = endpoint.and_then(|e| e.identity.as_ref()) {
            dest_labels.insert("server_id".to_string(), id.clone());
        }
        let base = TapEvent {
            source: source.map(tcp),
            source_meta: Some(tap_event::EndpointMeta {
                labels: source_labels,
            }),
            route_meta: Some(tap_event::RouteMeta {
                labels: HashMap::new(),
            }),
            destination: destination.map(tcp),
            destination_meta: Some(tap_event::EndpointMeta {
                labels: dest_labels,
            }),
            proxy_direction: match direction {
                "inbound" => tap_event::ProxyDirection::Inbound,
                _ => tap_event::ProxyDirection::Outbound,
            } as i32,
            event: None,
        };
        let id = ev::StreamId {
            base: 0,
            stream: self.id,
        };
        let headers = |yes: bool| {
            yes.then(|| http_types::Headers {
                headers: self
                    .headers
                    .iter()
                    .map(|(name, value)| http_types::headers::Header {
                        name: name.clone(),
                        value: value.clone(),
                    })
                    .collect(),
            })
        };
        let http = |e: ev::Event| Some(tap_event::Event::Http(tap_event::Http { event: Some(e) }));
        for (events, with_headers) in &matched {
            let init = ev::RequestInit {
                id: Some(id),
                method: Some(HttpMethod::from(self.method.clone())),
                scheme: self.scheme.as_ref().map(Scheme::from),
                authority: self.authority.clone(),
                path: self.path.clone(),
                headers: headers(*with_headers),
            };
            tap.send(
                events,
                TapEvent {
                    event: http(ev::Event::RequestInit(init)),
                    ..base.clone()
                },
            );
            let rsp = ev::ResponseInit {
                id: Some(id),
                since_request_init: Some(duration(responded - self.started)),
                http_status: status.as_u16().into(),
                headers: None,
            };
            tap.send(
                events,
                TapEvent {
                    event: http(ev::Event::ResponseInit(rsp)),
                    ..base.clone()
                },
            );
        }
        Some(TapEnd {
            base,
            id,
            started: self.started,
            responded,
            observers: matched.into_iter().map(|(e, _)| e).collect(),
            tap: tap.clone(),
        })
    }
}

impl TapEnd {
    /// The response ended with `class` (`2xx`…, `grpc_error`, `error`): the
    /// class is reported as the route label `status_class`.
    pub fn finish(self, class: &str) {
        let now = Instant::now();
        let mut base = self.base;
        if let Some(meta) = &mut base.route_meta {
            meta.labels
                .insert("status_class".to_string(), class.to_string());
        }
        let end = ev::ResponseEnd {
            id: Some(self.id),
            since_request_init: Some(duration(now - self.started)),
            since_response_init: Some(duration(now - self.responded)),
            response_bytes: 0,
            eos: None,
            trailers: None,
        };
        let event = TapEvent {
            event: Some(tap_event::Event::Http(tap_event::Http {
                event: Some(ev::Event::ResponseEnd(end)),
            })),
            ..base
        };
        for events in &self.observers {
            self.tap.send(events, event.clone());
        }
    }
}

fn string_match(m: Option<&m::http::StringMatch>, values: &[&str]) -> bool {
    use m::http::string_match::Match;
    match m.and_then(|m| m.r#match.as_ref()) {
        Some(Match::Exact(e)) => values.iter().any(|v| v.eq_ignore_ascii_case(e)),
        Some(Match::Prefix(p)) => values.iter().any(|v| v.starts_with(p.as_str())),
        None => true,
    }
}

fn tcp_match(m: &m::Tcp, addr: Option<SocketAddr>) -> bool {
    let Some(addr) = addr else { return false };
    match &m.r#match {
        Some(m::tcp::Match::Ports(r)) => {
            let port = u32::from(addr.port());
            r.min <= port && (r.max == 0 || port <= r.max)
        }
        Some(m::tcp::Match::Netmask(n)) => {
            let Some(ip) = n.ip.and_then(|ip| IpAddr::try_from(ip).ok()) else {
                return false;
            };
            let bits = |ip: IpAddr| match ip {
                IpAddr::V4(v) => (u128::from(u32::from(v)), 32),
                IpAddr::V6(v) => (u128::from(v), 128),
            };
            let ((want, len), (have, len2)) = (bits(ip), bits(addr.ip()));
            if len != len2 {
                return false;
            }
            let mask = n.mask.min(len);
            let shift = len - mask;
            mask == 0 || (want >> shift) == (have >> shift)
        }
        None => true,
    }
}

/// Whether a request meets an observer's match (none: everything).
fn matches(filter: Option<&observe_request::Match>, f: &Facts<'_>) -> bool {
    let Some(kind) = filter.and_then(|m| m.r#match.as_ref()) else {
        return true;
    };
    match kind {
        MatchKind::All(seq) => seq.matches.iter().all(|m| matches(Some(m), f)),
        MatchKind::Any(seq) => seq.matches.iter().any(|m| matches(Some(m), f)),
        MatchKind::Not(m) => !matches(Some(m), f),
        MatchKind::Source(t) => tcp_match(t, f.source),
        MatchKind::Destination(t) => tcp_match(t, f.destination),
        MatchKind::DestinationLabel(l) => f.destination_labels.get(&l.key) == Some(&l.value),
        MatchKind::RouteLabel(l) => f.route_labels.get(&l.key) == Some(&l.value),
        MatchKind::Http(h) => match &h.r#match {
            Some(m::http::Match::Scheme(s)) => {
                let want: Result<http::uri::Scheme, _> = s.clone().try_into();
                want.ok().as_ref() == f.req.scheme.as_ref()
            }
            Some(m::http::Match::Method(method)) => {
                http::Method::try_from(method.clone()).ok().as_ref() == Some(&f.req.method)
            }
            Some(m::http::Match::Authority(a)) => {
                string_match(Some(a), &[f.authority, &f.req.authority])
            }
            Some(m::http::Match::Path(p)) => string_match(Some(p), &[&f.req.path]),
            None => true,
        },
    }
}

struct TapService {
    tap: Tap,
}

type EventStream =
    Pin<Box<dyn futures::Stream<Item = Result<TapEvent, tonic::Status>> + Send + 'static>>;

#[tonic::async_trait]
impl TapApi for TapService {
    type ObserveStream = EventStream;

    async fn observe(
        &self,
        request: tonic::Request<ObserveRequest>,
    ) -> Result<tonic::Response<EventStream>, tonic::Status> {
        let rx = self.tap.subscribe(request.into_inner())?;
        let stream =
            futures::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|e| (e, rx)) });
        Ok(tonic::Response::new(Box::pin(stream)))
    }
}

/// A connection admitted to the tap API.
struct TapIo(BoxedIo);

impl tonic::transport::server::Connected for TapIo {
    type ConnectInfo = ();
    fn connect_info(&self) -> Self::ConnectInfo {}
}

impl AsyncRead for TapIo {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut *self.0).poll_read(cx, buf)
    }
}

impl AsyncWrite for TapIo {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut *self.0).poll_write(cx, buf)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut *self.0).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut *self.0).poll_shutdown(cx)
    }
}

static REFUSAL_LOG: tether_core::log_limit::LogLimit =
    tether_core::log_limit::LogLimit::new(Duration::from_secs(5));

/// Admits a tap connection: loopback peers as they are; others only over
/// mTLS with an allowed identity.
async fn admit(
    stream: tokio::net::TcpStream,
    peer: SocketAddr,
    tls: Option<Arc<rustls::ServerConfig>>,
    allowed: &[String],
) -> Result<TapIo, String> {
    if peer.ip().is_loopback() {
        return Ok(TapIo(Box::new(stream)));
    }
    let Some(config) = tls.filter(|_| !allowed.is_empty()) else {
        return Err("not loopback, and no identity is allowed to tap".into());
    };
    let (io, client_id) = crate::tls::terminate(config, bytes::Bytes::new(), stream)
        .await
        .map_err(|e| format!("TLS: {e}"))?;
    match client_id {
        Some(id) if allowed.iter().any(|a| a.as_str() == &*id) => Ok(TapIo(io)),
        Some(id) => Err(format!(
            "identity {} may not tap",
            tether_core::truncate::for_log(&id)
        )),
        None => Err("no client certificate".into()),
    }
}

/// Serves the tap API on `listener` until `shutdown`.
pub async fn serve(
    listener: TcpListener,
    tap: Tap,
    config: TapConfig,
    tls: Option<Arc<rustls::ServerConfig>>,
    shutdown: Shutdown,
) {
    tap.allow_headers(config.headers.clone());
    let allowed = Arc::new(config.allowed_identities);
    let (tx, rx) = mpsc::channel::<std::io::Result<TapIo>>(MAX_OBSERVERS);
    let accept = {
        let shutdown = shutdown.clone();
        async move {
            loop {
                let (stream, peer) = tokio::select! {
                    a = tether_admin::accept(&listener, "tap") => a,
                    _ = shutdown.triggered() => return,
                };
                let (tx, tls, allowed) = (tx.clone(), tls.clone(), allowed.clone());
                tokio::spawn(async move {
                    match admit(stream, peer, tls, &allowed).await {
                        Ok(io) => {
                            let _ = tx.send(Ok(io)).await;
                        }
                        Err(reason) => {
                            if let Some(suppressed) = REFUSAL_LOG.allow() {
                                tracing::warn!(%peer, %reason, suppressed, "tap connection refused");
                            }
                        }
                    }
                });
            }
        }
    };
    tokio::spawn(accept);
    let incoming =
        futures::stream::unfold(
            rx,
            |mut rx| async move { rx.recv().await.map(|io| (io, rx)) },
        );
    let result = tonic::transport::Server::builder()
        .add_service(TapServer::new(TapService { tap }))
        .serve_with_incoming_shutdown(incoming, shutdown.triggered())
        .await;
    if let Err(e) = result {
        tracing::warn!(error = %e, "tap server stopped");
    }
}
