//! The inbound side: connections from peer proxies (or any client) to the
//! local app. Nothing here needs the control plane (once a certificate is
//! held, when identity is on).
//!
//! Per connection: read the first bytes. A TLS ClientHello is terminated
//! with our certificate, the client's certificate is verified against the
//! trust root, and its identity is kept for the connection; then the
//! protocol inside is detected again. Under mandatory TLS anything else is
//! refused. HTTP is served and forwarded to the app (HTTP/1 when the peer
//! marked the request as originally HTTP/1, HTTP/2 otherwise), with the
//! client's verified identity in `tether-client-id` and `l5d-client-id` (a value sent by the
//! client itself is always removed). Anything that is not HTTP is refused,
//! unless the app's port is declared opaque (`--inbound-opaque`): then
//! connections are forwarded byte for byte without detection.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{HeaderValue, Request, Response, Version};
use http_body_util::BodyExt;
use rustls::ServerConfig;
use tether_admin::Shutdown;
use tether_core::log_limit::LogLimit;
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};

use crate::authz::{Authorizer, InboundPolicy, Verdict};
use crate::client::EndpointClient;
use crate::detect::{self, detect, PrefixedIo, Protocol, Unrecognized};
use crate::errors::ProxyError;
use crate::http::Proto;
use crate::http::{
    error_response, is_grpc, raw_bad_request, request_authority, rewrite_for_hop, strip_hop_by_hop,
    strip_hop_by_hop_response_and, strip_mesh_asserted, take_orig_proto, HopAuthority, ReplyBody,
    CLIENT_ID_HEADER, L5D_CLIENT_ID_HEADER, ORIG_PROTO_HEADER, PROXY_ERROR_HEADER,
};
use crate::inbound_policy::{Client, Workload};
use crate::metrics::{CountedBody, Hop, ProxyMetrics, Series};
use crate::serve::{accept_loop, serve_http, Conn, RequestBody, ServeLimits};
use crate::tls::{BoxedIo, Connector, TlsMode};

/// How long a client may take to send its first bytes (and, on a
/// declared-opaque port, before it counts as waiting for the app to speak).
const DETECT_TIMEOUT: Duration = Duration::from_secs(10);
/// The first byte of a TLS handshake record.
const TLS_HANDSHAKE: u8 = 0x16;
/// Refused connections are counted one by one but logged at most this often.
static REFUSAL_LOG: LogLimit = LogLimit::new(Duration::from_secs(5));
/// Failed requests (the app unreachable) are counted in the request
/// metrics; the log says it is happening at most this often.
static FAILURE_LOG: LogLimit = LogLimit::new(Duration::from_secs(5));

/// Why a connection to a port that is not declared opaque was refused.
enum Refusal {
    /// A peer proxy sent opaque TCP: its discovery says the port is opaque,
    /// this proxy was not told so (`--inbound-opaque`).
    OpaqueUndeclared,
    NotHttp(Unrecognized),
    /// A transport header that could not be read.
    TransportHeader(crate::transport_header::HeaderError),
    /// A transport header naming a port this proxy does not front.
    OtherPort(u16),
    /// A transport header naming a gateway target: this is no gateway.
    GatewayName,
}

impl Refusal {
    fn reason(&self) -> &'static str {
        match self {
            Refusal::OpaqueUndeclared => "opaque_undeclared",
            Refusal::NotHttp(why) => why.reason(),
            Refusal::TransportHeader(e) => e.reason(),
            Refusal::OtherPort(_) => "transport_header_port",
            Refusal::GatewayName => "transport_header_name",
        }
    }
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Refusal::OpaqueUndeclared => f.write_str(
                "opaque TCP to a port not declared opaque (start the proxy with --inbound-opaque)",
            ),
            Refusal::NotHttp(why) => write!(f, "{why}"),
            Refusal::TransportHeader(e) => write!(f, "{e}"),
            Refusal::OtherPort(port) => write!(
                f,
                "transport header names port {port}, which this proxy does not front"
            ),
            Refusal::GatewayName => {
                f.write_str("transport header names a gateway target; this proxy is not a gateway")
            }
        }
    }
}

/// The inbound side of a sidecar.
#[derive(Clone, Debug)]
pub struct InboundConfig {
    /// Where peer proxies (or any client) connect.
    pub listen: SocketAddr,
    /// The local app.
    pub app: SocketAddr,
    /// The app's port is declared opaque: TCP is forwarded as is, without
    /// detection. Otherwise only HTTP is forwarded and the rest refused.
    pub opaque: bool,
    /// Who may call the app (the proxy's default policy).
    pub policy: InboundPolicy,
    /// The workload this proxy fronts: with it, the control plane's
    /// policy for the app's port is followed (`InboundServerPolicies`).
    pub workload: Option<Workload>,
}

pub struct Inbound {
    app: SocketAddr,
    client: EndpointClient,
    connector: Arc<Connector>,
    metrics: ProxyMetrics,
    tls: Option<Arc<ServerConfig>>,
    mode: TlsMode,
    /// The app's port is declared opaque: TCP is forwarded without
    /// detection; otherwise only HTTP is.
    opaque: bool,
    authz: Authorizer,
    /// The metric labels of the authorities requests name.
    authorities: AuthorityLabels,
}

impl Inbound {
    pub fn new(
        config: &InboundConfig,
        metrics: ProxyMetrics,
        connect_timeout: Duration,
        tls: Option<Arc<ServerConfig>>,
        mode: TlsMode,
        authz: Authorizer,
    ) -> Self {
        if config.policy.audit {
            tracing::warn!("inbound policy audit is on (--inbound-policy-audit): requests and connections the policy denies are let through");
        }
        metrics.authz.audit.set(i64::from(config.policy.audit));
        let connector = Connector::plain(connect_timeout);
        // A peer proxy that offers the transport header's ALPN (as
        // linkerd2-proxy does for opaque TCP) gets it; one that offers no
        // ALPN sends no header. The usual protocols are listed too: TLS
        // refuses a client whose ALPN list meets none of the server's.
        let tls = tls.map(|config| {
            let mut config = (*config).clone();
            config.alpn_protocols = [crate::transport_header::ALPN, b"h2", b"http/1.1"]
                .map(<[u8]>::to_vec)
                .to_vec();
            Arc::new(config)
        });
        Self {
            app: config.app,
            client: EndpointClient::new(config.app, None, connector.clone()),
            connector,
            metrics,
            tls,
            mode,
            opaque: config.opaque,
            authz,
            authorities: AuthorityLabels::new(config.app.to_string().into()),
        }
    }

    pub async fn serve(
        self: Arc<Self>,
        listener: TcpListener,
        shutdown: Shutdown,
        limits: ServeLimits,
    ) {
        accept_loop(
            "inbound",
            listener,
            shutdown,
            limits,
            move |stream, peer, conn| {
                let this = self.clone();
                async move {
                    let _open = this.metrics.connection("inbound");
                    this.serve_connection(stream, peer, conn).await;
                }
            },
        )
        .await
    }

    async fn serve_connection(
        self: Arc<Self>,
        mut stream: TcpStream,
        peer: SocketAddr,
        conn: Conn,
    ) {
        // A TLS ClientHello starts with the handshake record type; one read
        // tells TLS from plaintext.
        let deadline = Instant::now() + DETECT_TIMEOUT;
        let Ok(first) = detect::first_bytes(&mut stream, DETECT_TIMEOUT).await else {
            return;
        };
        let local_port = stream.local_addr().map_or(0, |a| a.port());
        let is_tls = first.first() == Some(&TLS_HANDSHAKE);
        let mut transport_header = false;
        let (mut io, read, hop): (BoxedIo, Bytes, Hop) = match (&self.tls, is_tls) {
            (Some(config), true) => {
                match crate::tls::terminate_negotiated(config.clone(), first, stream).await {
                    Ok(t) => {
                        transport_header = t.transport_header;
                        (
                            t.io,
                            Bytes::new(),
                            Hop {
                                tls: true,
                                client_id: t.client_id,
                                peer: Some(peer),
                                ..Hop::default()
                            },
                        )
                    }
                    Err(e) => {
                        self.metrics.refuse("tls_handshake");
                        if let Some(suppressed) = REFUSAL_LOG.allow() {
                            tracing::warn!(%peer, error = %e, suppressed, "inbound TLS handshake failed");
                        }
                        return;
                    }
                }
            }
            _ if self.mode == TlsMode::Mandatory => {
                self.metrics.refuse("plaintext");
                if let Some(suppressed) = REFUSAL_LOG.allow() {
                    tracing::warn!(%peer, suppressed, "plaintext connection refused: TLS is mandatory");
                }
                return;
            }
            _ => (
                Box::new(stream),
                first,
                Hop {
                    peer: Some(peer),
                    ..Hop::default()
                },
            ),
        };
        if transport_header {
            return self
                .serve_transport_header(io, peer, local_port, hop, conn)
                .await;
        }
        if self.opaque {
            let silent = !hop.tls && read.is_empty();
            let prefix = if silent {
                // The client waits for the app to speak first.
                read
            } else {
                match detect::opaque_start(&mut io, read, DETECT_TIMEOUT).await {
                    Ok(p) => p,
                    Err(_) => return,
                }
            };
            return self.forward_tcp(io, prefix, peer, &hop).await;
        }
        // Inside TLS the client gets the whole time again, after the handshake.
        let left = if hop.tls {
            DETECT_TIMEOUT
        } else {
            deadline.saturating_duration_since(Instant::now())
        };
        let (proto, prefix) = match detect(&mut io, read, left).await {
            Ok(d) => d,
            Err(e) => {
                tracing::debug!(%peer, error = %e, "inbound detection failed");
                return;
            }
        };
        let refusal = match proto {
            Protocol::Closed => return,
            Protocol::Http => {
                return self
                    .serve_http(PrefixedIo::new(prefix, io), hop, conn)
                    .await
            }
            Protocol::OpaqueTransport => Refusal::OpaqueUndeclared,
            Protocol::Unrecognized(why) => Refusal::NotHttp(why),
        };
        self.refuse(&refusal, peer);
        if let Refusal::NotHttp(why) = refusal {
            if why.answer_400() {
                let _ = io.write_all(&raw_bad_request(&why.to_string())).await;
                let _ = io.shutdown().await;
            }
        }
    }

    fn refuse(&self, refusal: &Refusal, peer: SocketAddr) {
        self.metrics.refuse(refusal.reason());
        if let Some(suppressed) = REFUSAL_LOG.allow() {
            tracing::warn!(%peer, reason = %refusal, suppressed, "inbound connection refused");
        }
    }

    async fn serve_http<I: crate::tls::Io>(self: Arc<Self>, io: I, hop: Hop, conn: Conn) {
        let peer = Arc::new(PeerId::new(hop));
        let svc = move |req| {
            let (this, peer) = (self.clone(), peer.clone());
            async move { this.handle(req, &peer).await }
        };
        serve_http(io, svc, conn).await
    }

    /// A peer proxy agreed on ALPN `transport.l5d.io/v1`, so a transport
    /// header comes first (linkerd2-proxy's convention for opaque TCP):
    /// it names the target port and whether HTTP follows. This proxy
    /// fronts one app, so the port must be the app's, or the port the
    /// client connected to (the endpoint address discovery gave it);
    /// opaque TCP needs the app's port declared opaque, as it does without
    /// a header.
    async fn serve_transport_header(
        self: Arc<Self>,
        mut io: BoxedIo,
        peer: SocketAddr,
        local_port: u16,
        hop: Hop,
        conn: Conn,
    ) {
        let (target, rest) =
            match crate::transport_header::read(&mut io, Bytes::new(), DETECT_TIMEOUT).await {
                Ok(read) => read,
                Err(e) => {
                    return self.refuse(&Refusal::TransportHeader(e), peer);
                }
            };
        let refusal = if target.name.is_some() {
            Refusal::GatewayName
        } else if target.port != self.app.port() && target.port != local_port {
            Refusal::OtherPort(target.port)
        } else if target.http {
            return self.serve_http(PrefixedIo::new(rest, io), hop, conn).await;
        } else if self.opaque {
            return self.forward_tcp(io, rest, peer, &hop).await;
        } else {
            Refusal::OpaqueUndeclared
        };
        self.refuse(&refusal, peer);
    }

    async fn handle(
        &self,
        mut req: Request<RequestBody>,
        peer_id: &PeerId,
    ) -> Response<CountedBody> {
        let hop = &peer_id.hop;
        let start = Instant::now();
        let tapped = self.metrics.tap.request(&req);
        let upgrade = crate::upgrade::take(&mut req);
        let grpc = is_grpc(req.headers());
        let (authority, label) = match request_authority(&req) {
            Some(named) => self.authorities.label(named),
            None => self.authorities.label(&self.app.to_string()),
        };
        if req.method() == http::Method::CONNECT {
            let rsp = error_response(&ProxyError::ConnectUnsupported, grpc).map(ReplyBody::Made);
            let (series, _) = peer_id.last(&self.metrics, &authority, label);
            return self
                .metrics
                .record_series(rsp, series, start.elapsed(), hop, None);
        }
        let peer = hop
            .peer
            .unwrap_or_else(|| SocketAddr::from(([0, 0, 0, 0], 0)));
        let verdict = self
            .authz
            .check_request(&req, &authority, &client_of(hop, peer));
        if let Some(error) = self.refusal(verdict) {
            let (series, _) = peer_id.last(&self.metrics, &authority, label);
            return self.metrics.record_series(
                error_response(&error, grpc).map(ReplyBody::Made),
                series,
                start.elapsed(),
                hop,
                None,
            );
        }
        let version = req.version();
        let (mut parts, body) = req.into_parts();
        let orig = if version == Version::HTTP_2 {
            take_orig_proto(&mut parts.headers)
        } else {
            None
        };
        strip_hop_by_hop(&mut parts.headers);
        strip_mesh_asserted(&mut parts.headers);
        if let Some(id) = &peer_id.header {
            parts.headers.insert(CLIENT_ID_HEADER, id.clone());
            parts.headers.insert(L5D_CLIENT_ID_HEADER, id.clone());
        }
        let proto = if orig.is_some() || version != Version::HTTP_2 {
            Proto::Http1
        } else {
            Proto::Http2
        };
        let (series, hop_authority) = peer_id.last(&self.metrics, &authority, label);
        let result = match self.client.connection(proto).await {
            Ok(conn) => conn
                .send(rewrite_for_hop(
                    parts,
                    boxed_unless_empty(body),
                    &hop_authority,
                    proto,
                    orig,
                ))
                .await
                .map_err(|e| ProxyError::App {
                    addr: self.app,
                    reason: e.to_string(),
                }),
            Err(e) => Err(ProxyError::App {
                addr: self.app,
                reason: e.to_string(),
            }),
        };
        let result = result.and_then(|rsp| {
            if upgrade.is_none() && rsp.status() == http::StatusCode::SWITCHING_PROTOCOLS {
                return Err(ProxyError::App {
                    addr: self.app,
                    reason: crate::upgrade::UNASKED_SWITCH.into(),
                });
            }
            Ok(rsp)
        });
        let mut rsp = match result {
            Ok(rsp) => {
                let (mut parts, body) = rsp.into_parts();
                // Only the proxy may say that it, not the app, failed: the
                // client's proxy retries on that word.
                strip_hop_by_hop_response_and(
                    parts.status,
                    &mut parts.headers,
                    &[PROXY_ERROR_HEADER, ORIG_PROTO_HEADER],
                );
                if orig.is_some_and(|o| !o.legacy) {
                    // As linkerd2-proxy's inbound answers (its outbound
                    // removes it); a Tether proxy older than this name
                    // would pass it on to its app, so it gets none.
                    parts
                        .headers
                        .insert(ORIG_PROTO_HEADER, HeaderValue::from_static("HTTP/1.1"));
                }
                Response::from_parts(parts, ReplyBody::Upstream(body))
            }
            Err(e) => {
                if let Some(suppressed) = FAILURE_LOG.allow() {
                    tracing::warn!(error = %e, suppressed, "inbound request failed");
                }
                error_response(&e, grpc).map(ReplyBody::Made)
            }
        };
        if let Some(upgrade) = upgrade {
            upgrade.splice(&mut rsp);
        }
        self.metrics
            .record_series(rsp, series, start.elapsed(), hop, tapped)
    }

    /// What a verdict answers: `Some` error when the request is refused
    /// (a denial counted), `None` when it may go on (counted under audit).
    fn refusal(&self, verdict: Verdict) -> Option<ProxyError> {
        match verdict {
            Verdict::Allow => None,
            Verdict::Audit(denial) => {
                self.metrics.authz.count(&denial, true);
                None
            }
            Verdict::Deny(denial) => {
                self.metrics.authz.count(&denial, false);
                Some(ProxyError::Unauthorized {
                    client: denial.client,
                    server: denial.server,
                    route: denial.route,
                })
            }
            Verdict::NoRoute(server) => Some(ProxyError::NoRoute(server)),
        }
    }

    /// Whether the connection's client may connect, as policy says now
    /// (a denial counted and logged).
    fn admits_connection(&self, hop: &Hop, peer: SocketAddr) -> bool {
        let verdict = self.authz.check_connection(&client_of(hop, peer));
        match self.refusal(verdict) {
            None => true,
            Some(error) => {
                if let Some(suppressed) = REFUSAL_LOG.allow() {
                    tracing::warn!(%peer, %error, suppressed, "inbound TCP connection denied by policy");
                }
                false
            }
        }
    }

    async fn forward_tcp(&self, mut client: BoxedIo, prefix: Bytes, peer: SocketAddr, hop: &Hop) {
        if !self.admits_connection(hop, peer) {
            let _ = client.shutdown().await;
            return;
        }
        let mut app = match self.connector.connect(self.app, None).await {
            Ok((s, _)) => s,
            Err(reason) => {
                tracing::warn!(%peer, app = %self.app, %reason, "app unreachable for opaque connection");
                return;
            }
        };
        if !prefix.is_empty() && app.write_all(&prefix).await.is_err() {
            return;
        }
        // A policy change that denies the client closes the connection.
        let mut policy = self.authz.clone();
        let copied = {
            let copy = tokio::io::copy_bidirectional(&mut client, &mut app);
            tokio::pin!(copy);
            loop {
                tokio::select! {
                    biased;
                    copied = &mut copy => break copied,
                    _ = policy.changed() => {
                        if !self.admits_connection(hop, peer) {
                            return;
                        }
                    }
                }
            }
        };
        if let Ok((up, down)) = copied {
            self.metrics
                .tcp_bytes
                .get_or_create(&crate::metrics::DirectionLabels {
                    direction: "inbound".into(),
                })
                .inc_by(up + down + prefix.len() as u64);
        }
    }
}

/// Distinct authorities the inbound's metrics are labelled with. The
/// authority is the client's to choose (any `Host`): past these, requests
/// are counted under [`OTHER_AUTHORITIES`], or a client could add series
/// (memory, scrape size) without end. An app is known by a few names.
const MAX_AUTHORITY_LABELS: usize = 100;
/// The longest authority kept as a label (a DNS name and a port).
const MAX_AUTHORITY_LABEL_LEN: usize = 253 + 6;
/// The label of the authorities past [`MAX_AUTHORITY_LABELS`] or longer
/// than [`MAX_AUTHORITY_LABEL_LEN`]; no authority is spelled so.
pub const OTHER_AUTHORITIES: &str = "(other)";

/// The metric labels of the authorities an inbound's requests name,
/// bounded in number and length.
struct AuthorityLabels {
    inner: std::sync::Mutex<Labels>,
}

struct Labels {
    /// The authority requests named last: an inbound sees one (its app's
    /// service) nearly always, so it is shared rather than looked up or
    /// copied per request.
    last: Arc<str>,
    known: std::collections::HashSet<Arc<str>>,
    other: Arc<str>,
}

impl AuthorityLabels {
    fn new(first: Arc<str>) -> Self {
        Self {
            inner: std::sync::Mutex::new(Labels {
                known: [first.clone()].into(),
                last: first,
                other: OTHER_AUTHORITIES.into(),
            }),
        }
    }

    /// `authority`, shared, and its metric label: the same, or past the
    /// bounds [`OTHER_AUTHORITIES`].
    fn label(&self, authority: &str) -> (Arc<str>, Arc<str>) {
        let mut labels = self.inner.lock().unwrap();
        if *labels.last != *authority {
            match labels.known.get(authority) {
                Some(known) => labels.last = known.clone(),
                None if labels.known.len() < MAX_AUTHORITY_LABELS
                    && authority.len() <= MAX_AUTHORITY_LABEL_LEN =>
                {
                    labels.last = authority.into();
                    let label = labels.last.clone();
                    labels.known.insert(label);
                }
                None => return (authority.into(), labels.other.clone()),
            }
        }
        (labels.last.clone(), labels.last.clone())
    }
}

/// What a connection's requests carry of its client: the hop, and its
/// verified identity as a header value, made once per connection.
struct PeerId {
    hop: Hop,
    header: Option<HeaderValue>,
    /// The metric series its requests were counted in last, the
    /// authority they named and that authority parsed for the app's hop:
    /// a connection's requests name the same one nearly always.
    last: std::sync::Mutex<Option<LastNamed>>,
}

impl PeerId {
    fn new(hop: Hop) -> Self {
        let header = hop
            .client_id
            .as_deref()
            .and_then(|id| HeaderValue::from_str(id).ok());
        Self {
            hop,
            header,
            last: Default::default(),
        }
    }

    /// The series of this client's requests counted under `label`, and
    /// `authority` (what they named) parsed for the hop to the app.
    fn last(
        &self,
        metrics: &ProxyMetrics,
        authority: &Arc<str>,
        label: Arc<str>,
    ) -> (Arc<Series>, HopAuthority) {
        let mut last = self.last.lock().unwrap();
        if let Some(named) = &*last {
            if named.series.is_for(&label) && *named.authority == **authority {
                return (named.series.clone(), named.hop.clone());
            }
        }
        let hop = HopAuthority::new(authority);
        let client_id = self.hop.client_id.clone();
        let series = Arc::new(metrics.series("inbound", label, client_id));
        *last = Some(LastNamed {
            series: series.clone(),
            authority: authority.clone(),
            hop: hop.clone(),
        });
        (series, hop)
    }
}

/// What [`PeerId`] keeps of the authority its requests named last.
struct LastNamed {
    series: Arc<Series>,
    authority: Arc<str>,
    hop: HopAuthority,
}

/// A request body to send on: one that has ended already (most requests
/// have no body) becomes an empty body, which boxing does not allocate.
fn boxed_unless_empty(body: RequestBody) -> crate::http::Body {
    if hyper::body::Body::is_end_stream(&body) {
        crate::http::empty()
    } else {
        body.boxed()
    }
}

/// The client of a connection, as policy sees it: the identity its
/// verified certificate names, never a header it sent.
fn client_of(hop: &Hop, peer: SocketAddr) -> Client<'_> {
    Client {
        identity: hop.client_id.as_deref(),
        tls: hop.tls,
        ip: peer.ip(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A client names any authority it likes: the labels (metric series)
    /// they make are bounded in number and length.
    #[test]
    fn a_clients_authorities_make_bounded_labels() {
        let labels = AuthorityLabels::new("10.0.0.1:8080".into());
        let mut seen = std::collections::HashSet::new();
        let mut label = |authority: &str| {
            let (named, label) = labels.label(authority);
            // Only the label is bounded: authorization and the app see
            // the authority as it came.
            assert_eq!(&*named, authority);
            seen.insert(label);
        };
        for i in 0..3 * MAX_AUTHORITY_LABELS {
            label(&format!("host-{i}:80"));
        }
        label(&"x".repeat(10_000));
        assert!(
            seen.len() <= MAX_AUTHORITY_LABELS + 1,
            "{} labels",
            seen.len()
        );
        assert!(seen.iter().all(|l| l.len() <= MAX_AUTHORITY_LABEL_LEN));
        assert!(seen.contains(OTHER_AUTHORITIES));
        // The first ones seen keep their own.
        assert_eq!(&*labels.label("10.0.0.1:8080").1, "10.0.0.1:8080");
        assert_eq!(&*labels.label("host-1:80").1, "host-1:80");
    }

    /// Requests counted under one label (past the bound) still reach the
    /// app with the authority each named, not the last one's.
    #[test]
    fn the_app_gets_the_authority_named_whatever_its_label() {
        let peer = PeerId::new(Hop::default());
        let metrics = ProxyMetrics::default();
        let other: Arc<str> = OTHER_AUTHORITIES.into();
        for named in [
            "a.example:80",
            "b.example:80",
            "b.example:80",
            "a.example:80",
        ] {
            let (_, hop) = peer.last(&metrics, &named.into(), other.clone());
            let (parts, ()) = http::Request::new(()).into_parts();
            let req = rewrite_for_hop(parts, crate::http::empty(), &hop, Proto::Http1, None);
            assert_eq!(req.headers()[http::header::HOST], named);
        }
    }
}
