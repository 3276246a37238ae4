//! The control plane's policy for the inbound port:
//! `InboundServerPolicies.WatchPort` followed into a `watch`, and its
//! `Server` in the form the inbound checks per request and connection.
//!
//! Conversion makes the checks linkerd2-proxy's
//! (`linkerd/proxy/server-policy`) makes, so a control plane that serves
//! linkerd2-proxy serves this proxy the same way, and an answer is taken
//! whole or refused whole (the last good one, or the proxy's default
//! policy, stays in force): a protocol is required (a detection timeout
//! with it), every authorization has at least one network and an
//! authentication, servers and authorizations are named by their labels
//! (`name`, `kind`) or metadata, routes by their metadata, and every route
//! has rules whose matches parse. Route matching is the outbound's
//! ([`crate::policy::select`]); route filters are not applied.
//!
//! Semantics, as linkerd2-proxy's: a client is admitted by the first
//! authorization whose networks hold its address (outside the
//! exceptions) and whose authentication it meets (any client; any mesh
//! TLS client; or a TLS client whose verified identity is listed exactly
//! or ends with a listed suffix). HTTP requests are checked against the
//! authorizations of the route they match (the route's own, then the
//! server's), other connections against the server's. An opaque or TLS
//! server has no routes: its requests are checked as connections. An
//! authorization of kind `default` named `audit` admits as audit: let
//! through, logged and counted as a would-be denial. Unlike
//! linkerd2-proxy, loopback clients get no implicit authorization: on one
//! machine every proxy's peer is on loopback.

use std::collections::{HashMap, HashSet};
use std::net::IpAddr;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use linkerd2_proxy_api::inbound::{
    self as api, inbound_server_policies_client::InboundServerPoliciesClient, PortSpec,
};
use linkerd2_proxy_api::meta;
use prometheus_client::metrics::counter::Counter;
use tether_admin::{Readiness, Shutdown};
use tether_core::backoff::{jittered, Backoff};
use tether_core::log_limit::LogLimit;
use tokio::sync::watch;

use crate::authz::Network;
use crate::discovery::{ControlPlanes, MAX_MESSAGE_BYTES};
use crate::policy::{PolicyError, Route};

/// The readiness condition a proxy following its inbound policy waits for.
pub const INBOUND_POLICY: &str = "inbound-policy";

/// Longest server, route or authorization name kept (they become metric
/// labels and error messages).
const MAX_NAME: usize = 128;

/// Why an answer was refused.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct InvalidServer(String);

fn invalid(what: impl std::fmt::Display) -> InvalidServer {
    InvalidServer(tether_core::truncate::bounded_message(what))
}

impl From<PolicyError> for InvalidServer {
    fn from(e: PolicyError) -> Self {
        invalid(e)
    }
}

/// The workload this proxy fronts, as `PortSpec.workload` names it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Workload {
    pub namespace: String,
    pub name: String,
}

impl std::str::FromStr for Workload {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let bad = || {
            format!(
                "{:?} is not a workload NAMESPACE/NAME (letters, digits, '-', '.', '_')",
                tether_core::truncate::for_log(s)
            )
        };
        let (namespace, name) = s.split_once('/').ok_or_else(bad)?;
        let ok = |p: &str| {
            !p.is_empty()
                && p.len() <= 253
                && p.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_'))
        };
        if !ok(namespace) || !ok(name) {
            return Err(bad());
        }
        Ok(Self {
            namespace: namespace.into(),
            name: name.into(),
        })
    }
}

impl Workload {
    /// The JSON form stock Linkerd injects (`{"ns":…,"pod":…}`); the parts
    /// need no escaping (checked on parsing).
    pub fn spec(&self) -> String {
        format!(r#"{{"ns":"{}","pod":"{}"}}"#, self.namespace, self.name)
    }
}

/// The client of a request or connection.
#[derive(Clone, Copy, Debug)]
pub struct Client<'a> {
    /// Its verified mesh identity (mTLS); never a header it sent.
    pub identity: Option<&'a str>,
    /// Whether it spoke TLS to this proxy.
    pub tls: bool,
    pub ip: IpAddr,
}

#[derive(Debug)]
enum Authentication {
    Unauthenticated,
    /// Any TLS client.
    MeshTls,
    Identities {
        exact: HashSet<String>,
        /// `.a.b` for `*.a.b`; empty matches every identity.
        suffixes: Vec<String>,
    },
}

#[derive(Debug)]
struct AuthzNetwork {
    net: Network,
    except: Vec<Network>,
}

/// One authorization of a server or route.
#[derive(Debug)]
pub struct Authorization {
    networks: Vec<AuthzNetwork>,
    authentication: Authentication,
    /// `<name>`, or `default:<name>` for a default.
    pub name: String,
    /// Admits as audit (a would-be denial let through).
    pub audit: bool,
}

impl Authorization {
    fn admits(&self, client: &Client<'_>) -> bool {
        let in_networks = self
            .networks
            .iter()
            .any(|n| n.net.contains(client.ip) && !n.except.iter().any(|e| e.contains(client.ip)));
        in_networks
            && match &self.authentication {
                Authentication::Unauthenticated => true,
                Authentication::MeshTls => client.tls,
                Authentication::Identities { exact, suffixes } => {
                    client.identity.is_some_and(|id| {
                        exact.contains(id) || suffixes.iter().any(|s| id.ends_with(s.as_str()))
                    })
                }
            }
    }

    fn from_api(authz: api::Authz) -> Result<Self, InvalidServer> {
        let name = match authz.metadata {
            Some(m) => meta_name(m)?,
            None => label_name(&authz.labels, "serverauthorization")?,
        };
        let in_authz = |e: InvalidServer| invalid(format_args!("authorization {name}: {e}"));
        if authz.networks.is_empty() {
            return Err(in_authz(invalid("no networks")));
        }
        let networks = authz
            .networks
            .into_iter()
            .map(|n| {
                Ok(AuthzNetwork {
                    net: network(n.net.ok_or_else(|| invalid("a network without net"))?)?,
                    except: n
                        .except
                        .into_iter()
                        .map(network)
                        .collect::<Result<_, _>>()?,
                })
            })
            .collect::<Result<_, InvalidServer>>()
            .map_err(in_authz)?;
        use api::authn::{permit_mesh_tls::Clients, Permit};
        let authentication = match authz
            .authentication
            .and_then(|a| a.permit)
            .ok_or_else(|| in_authz(invalid("no authentication")))?
        {
            Permit::Unauthenticated(_) => Authentication::Unauthenticated,
            Permit::MeshTls(m) => match m
                .clients
                .ok_or_else(|| in_authz(invalid("meshTLS without clients")))?
            {
                Clients::Unauthenticated(_) => Authentication::MeshTls,
                Clients::Identities(ids) => Authentication::Identities {
                    exact: ids.identities.into_iter().map(|i| i.name).collect(),
                    suffixes: ids
                        .suffixes
                        .into_iter()
                        .map(|s| {
                            if s.parts.is_empty() {
                                String::new()
                            } else {
                                format!(".{}", s.parts.join("."))
                            }
                        })
                        .collect(),
                },
            },
        };
        Ok(Self {
            networks,
            authentication,
            audit: name == "default:audit",
            name,
        })
    }
}

fn network(n: linkerd2_proxy_api::net::IpNetwork) -> Result<Network, InvalidServer> {
    let ip = n
        .ip
        .ok_or_else(|| invalid("a network without an address"))
        .and_then(|ip| IpAddr::try_from(ip).map_err(|e| invalid(format_args!("network: {e}"))))?;
    let prefix = u8::try_from(n.prefix_len)
        .ok()
        .and_then(|p| Network::new(ip, p))
        .ok_or_else(|| {
            invalid(format_args!(
                "network {ip}/{}: invalid prefix",
                n.prefix_len
            ))
        })?;
    Ok(prefix)
}

/// A name for labels and messages, bounded.
fn shown(kind: &str, name: &str) -> String {
    let mut end = name.len().min(MAX_NAME);
    while !name.is_char_boundary(end) {
        end -= 1;
    }
    let name = &name[..end];
    if kind == "default" {
        format!("default:{name}")
    } else {
        name.to_string()
    }
}

fn meta_name(m: meta::Metadata) -> Result<String, InvalidServer> {
    match m.kind.ok_or_else(|| invalid("metadata without a kind"))? {
        meta::metadata::Kind::Default(name) => Ok(shown("default", &name)),
        meta::metadata::Kind::Resource(r) => Ok(shown(&r.kind, &r.name)),
    }
}

/// As linkerd2-proxy reads labels: `name` is required; `kind` says
/// whether it is a default; without `kind`, `default:<name>` is one.
fn label_name(
    labels: &HashMap<String, String>,
    default_kind: &str,
) -> Result<String, InvalidServer> {
    let name = labels
        .get("name")
        .ok_or_else(|| invalid("no 'name' label"))?;
    Ok(match labels.get("kind") {
        Some(kind) => shown(kind, name),
        None => match name.split_once(':') {
            Some(("default", name)) => shown("default", name),
            Some((_, name)) => shown(default_kind, name),
            None => shown(default_kind, name),
        },
    })
}

/// Who may use a route (its own authorizations, then the server's) or
/// open a connection, and the counters of whom each admitted (found on
/// first use, so a request costs an atomic increment).
#[derive(Debug)]
struct RoutePolicy {
    authorizations: Vec<Arc<Authorization>>,
    allowed: Box<[OnceLock<Counter>]>,
}

impl RoutePolicy {
    fn new(authorizations: Vec<Arc<Authorization>>) -> Self {
        let allowed = authorizations.iter().map(|_| OnceLock::new()).collect();
        Self {
            authorizations,
            allowed,
        }
    }
}

/// The control plane's policy for this proxy's inbound port.
#[derive(Debug)]
pub struct ServerPolicy {
    /// `<name>`, or `default:<policy>` when no `Server` selects the port.
    pub name: String,
    /// No `Server` selects the port: this is a default policy.
    pub is_default: bool,
    /// Who may open a connection that is not HTTP (and, on an opaque or
    /// TLS server, send requests).
    connection: RoutePolicy,
    /// HTTP routes, with [`ServerPolicy::route_policies`] beside them in
    /// the same order; empty on an opaque or TLS server.
    routes: Vec<Route>,
    route_policies: Vec<RoutePolicy>,
}

/// What a server's policy says about one request or connection.
#[derive(Debug)]
pub enum Decision<'a> {
    Allowed {
        route: &'a str,
        authz: &'a str,
        audit: bool,
        /// Where the admission counts (`tether_proxy_inbound_allowed_total`).
        counter: &'a OnceLock<Counter>,
    },
    Denied {
        route: &'a str,
    },
    /// No route of the server matches the request.
    NoRoute,
}

/// The name of a server's route when it has none: every request.
const DEFAULT_ROUTE: &str = "default";

impl ServerPolicy {
    pub fn from_api(server: api::Server) -> Result<Self, InvalidServer> {
        use api::proxy_protocol::Kind;
        let name = label_name(&server.labels, "server")?;
        let is_default = name.starts_with("default:");
        let in_server = |e: InvalidServer| invalid(format_args!("server {name}: {e}"));
        let connection: Vec<Arc<Authorization>> = server
            .authorizations
            .into_iter()
            .map(|a| Authorization::from_api(a).map(Arc::new))
            .collect::<Result<_, _>>()
            .map_err(in_server)?;
        let kind = server
            .protocol
            .and_then(|p| p.kind)
            .ok_or_else(|| in_server(invalid("no protocol")))?;
        let http = |routes: Vec<api::HttpRoute>| {
            routes
                .into_iter()
                .map(|r| {
                    let name = route_meta(r.metadata)?;
                    let rules = r.rules.into_iter().map(|rule| rule.matches).collect();
                    let route = Route::inbound_http(name.into(), r.hosts, rules)?;
                    Ok((route, r.authorizations))
                })
                .collect::<Result<Vec<_>, InvalidServer>>()
        };
        let routes = match kind {
            Kind::Detect(d) => {
                let timeout = d
                    .timeout
                    .ok_or_else(|| in_server(invalid("detect: no timeout")))?;
                Duration::try_from(timeout)
                    .map_err(|e| in_server(invalid(format_args!("detect timeout: {e}"))))?;
                Some(http(d.http_routes).map_err(in_server)?)
            }
            Kind::Http1(h) => Some(http(h.routes).map_err(in_server)?),
            Kind::Http2(h) => Some(http(h.routes).map_err(in_server)?),
            Kind::Grpc(g) => Some(
                g.routes
                    .into_iter()
                    .map(|r| {
                        let name = route_meta(r.metadata)?;
                        let rules = r.rules.into_iter().map(|rule| rule.matches).collect();
                        let route = Route::inbound_grpc(name.into(), r.hosts, rules)?;
                        Ok((route, r.authorizations))
                    })
                    .collect::<Result<Vec<_>, InvalidServer>>()
                    .map_err(in_server)?,
            ),
            Kind::Opaque(_) | Kind::Tls(_) => None,
        };
        let (routes, route_policies) = match routes {
            None => (Vec::new(), Vec::new()),
            // A control plane without routes: one route for every request,
            // under the server's authorizations (as linkerd2-proxy does).
            Some(r) if r.is_empty() => (
                vec![Route::inbound_http(
                    DEFAULT_ROUTE.into(),
                    Vec::new(),
                    vec![Vec::new()],
                )?],
                vec![RoutePolicy::new(connection.clone())],
            ),
            Some(r) => {
                let mut routes = Vec::with_capacity(r.len());
                let mut policies = Vec::with_capacity(r.len());
                for (route, authzs) in r {
                    let own = authzs
                        .into_iter()
                        .map(|a| Authorization::from_api(a).map(Arc::new))
                        .collect::<Result<Vec<_>, _>>()
                        .map_err(|e| {
                            in_server(invalid(format_args!("route {}: {e}", route.name)))
                        })?;
                    policies.push(RoutePolicy::new(
                        own.into_iter().chain(connection.iter().cloned()).collect(),
                    ));
                    routes.push(route);
                }
                (routes, policies)
            }
        };
        Ok(Self {
            name,
            is_default,
            connection: RoutePolicy::new(connection),
            routes,
            route_policies,
        })
    }

    /// The decision for a connection that is not HTTP.
    pub fn check_connection(&self, client: &Client<'_>) -> Decision<'_> {
        decide(&self.connection, DEFAULT_ROUTE, client)
    }

    /// The decision for an HTTP request addressed to `authority`.
    pub fn check_request<B>(
        &self,
        req: &http::Request<B>,
        authority: &str,
        client: &Client<'_>,
    ) -> Decision<'_> {
        let host = authority.rsplit_once(':').map_or(authority, |(h, _)| h);
        if self.routes.is_empty() {
            // Opaque or TLS: only the server's authorizations apply.
            return self.check_connection(client);
        }
        let decision = self.check_route(req, host, client);
        // The app may read the path differently from the route matcher
        // (merged slashes, dot segments, percent-decoding, `;` parameters,
        // case): the request must also pass as the route its path may mean
        // there, or `//admin` would get past a policy on `/admin`.
        let Some(read_as) = app_reading(req) else {
            return decision;
        };
        match (&decision, self.check_route(&read_as, host, client)) {
            (Decision::NoRoute, _) | (_, Decision::NoRoute) => decision,
            (_, denied @ Decision::Denied { .. }) => denied,
            (
                Decision::Allowed { audit: false, .. },
                audited @ Decision::Allowed { audit: true, .. },
            ) => audited,
            _ => decision,
        }
    }

    fn check_route<B>(
        &self,
        req: &http::Request<B>,
        host: &str,
        client: &Client<'_>,
    ) -> Decision<'_> {
        let Some(selected) = crate::policy::select(&self.routes, req, host) else {
            return Decision::NoRoute;
        };
        let index = self
            .routes
            .iter()
            .position(|r| std::ptr::eq(r, selected.route))
            .expect("the selected route is one of the server's");
        decide(&self.route_policies[index], &selected.route.name, client)
    }
}

/// The request as an app may read its path, when that differs from the
/// path as sent: percent-encoded unreserved characters and separators
/// decoded (once), a backslash read as `/`, empty and `.` segments
/// dropped, `..` resolved, `;` parameters dropped, the trailing `/`
/// dropped, lowercase (except gRPC).
fn app_reading<B>(req: &http::Request<B>) -> Option<http::Request<()>> {
    let path = req.uri().path();
    if !path.starts_with('/') {
        return None;
    }
    // gRPC names are case-sensitive on every server.
    let grpc = crate::http::is_grpc(req.headers());
    // Most paths are already as the app reads them: no allocation then.
    let plain = !path.contains(['%', '\\', ';'])
        && !path.contains("//")
        && !path.contains("/.")
        && (path.len() == 1 || !path.ends_with('/'))
        && (grpc || !path.bytes().any(|b| b.is_ascii_uppercase()));
    if plain {
        return None;
    }
    let mut decoded = Vec::with_capacity(path.len());
    let bytes = path.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        let escaped = (bytes[i] == b'%')
            .then(|| bytes.get(i + 1..i + 3))
            .flatten()
            .and_then(|hex| u8::from_str_radix(std::str::from_utf8(hex).ok()?, 16).ok())
            .filter(|b| b.is_ascii_alphanumeric() || b"-._~/\\".contains(b));
        match escaped {
            Some(b) => {
                decoded.push(b);
                i += 3;
            }
            None => {
                decoded.push(bytes[i]);
                i += 1;
            }
        }
    }
    let decoded = String::from_utf8_lossy(&decoded).replace('\\', "/");
    let mut segments: Vec<&str> = Vec::new();
    for segment in decoded.split('/') {
        match segment.split(';').next().unwrap_or("") {
            "" | "." => {}
            ".." => {
                segments.pop();
            }
            s => segments.push(s),
        }
    }
    let mut read = format!("/{}", segments.join("/"));
    if !grpc {
        read.make_ascii_lowercase();
    }
    if read == path {
        return None;
    }
    if let Some(query) = req.uri().query() {
        read = format!("{read}?{query}");
    }
    let uri = http::Uri::builder().path_and_query(read).build().ok()?;
    let mut read_as = http::Request::new(());
    *read_as.method_mut() = req.method().clone();
    *read_as.uri_mut() = uri;
    *read_as.headers_mut() = req.headers().clone();
    Some(read_as)
}

/// A route's name: the resource's, or a default's own (`default`), as
/// error messages show it after the server's name.
fn route_meta(m: Option<meta::Metadata>) -> Result<String, InvalidServer> {
    match m
        .and_then(|m| m.kind)
        .ok_or_else(|| invalid("a route without metadata"))?
    {
        meta::metadata::Kind::Default(name) => Ok(shown("", &name)),
        meta::metadata::Kind::Resource(r) => Ok(shown(&r.kind, &r.name)),
    }
}

fn decide<'a>(policy: &'a RoutePolicy, route: &'a str, client: &Client<'_>) -> Decision<'a> {
    match policy.authorizations.iter().position(|a| a.admits(client)) {
        Some(i) => Decision::Allowed {
            route,
            authz: &policy.authorizations[i].name,
            audit: policy.authorizations[i].audit,
            counter: &policy.allowed[i],
        },
        None => Decision::Denied { route },
    }
}

/// The control plane's policy for the port: `None` until a good answer.
pub type ServerState = Option<Arc<ServerPolicy>>;

/// Counters of answers applied and refused.
#[derive(Clone, Default)]
pub struct PolicyCounters {
    pub applied: Counter,
    pub refused: Counter,
}

const BACKOFF_MIN: Duration = Duration::from_millis(100);
const BACKOFF_MAX: Duration = Duration::from_secs(5);
/// However often the control plane sends a policy, it is logged at most
/// this often (each is counted).
static APPLIED_LOG: LogLimit = LogLimit::new(Duration::from_secs(5));
/// How often to ask again a control plane that serves no inbound policy
/// (an older one), or none for this workload.
const NO_POLICY_RETRY: Duration = Duration::from_secs(10);

/// What the watch task needs.
pub struct Follow {
    pub controls: Arc<ControlPlanes>,
    pub spec: PortSpec,
    pub counters: PolicyCounters,
    pub readiness: Readiness,
    pub first_answer_timeout: Duration,
}

impl Follow {
    /// Follows the port's policy into the returned `watch` until `stop`,
    /// reconnecting with backoff across the control planes. The readiness
    /// condition [`INBOUND_POLICY`] is met once the control plane has
    /// answered (a good answer, a refused one, or "none here").
    pub fn spawn(self, stop: Shutdown) -> watch::Receiver<ServerState> {
        self.readiness.require(INBOUND_POLICY);
        let (tx, rx) = watch::channel(None);
        tokio::spawn(async move {
            let mut backoff = Backoff::new(BACKOFF_MIN, BACKOFF_MAX);
            let mut attempt = 0usize;
            loop {
                let pause = tokio::select! {
                    pause = self.follow_once(attempt, &tx, &mut backoff) => pause,
                    _ = stop.triggered() => return,
                };
                attempt += 1;
                tokio::select! {
                    _ = tokio::time::sleep(pause) => {}
                    _ = stop.triggered() => return,
                }
            }
        });
        rx
    }

    /// One `WatchPort` stream until it ends; how long to pause before the
    /// next.
    async fn follow_once(
        &self,
        attempt: usize,
        tx: &watch::Sender<ServerState>,
        backoff: &mut Backoff,
    ) -> Duration {
        let port = self.spec.port;
        let picked = match self.controls.pick_one(attempt).await {
            Ok(p) => p,
            Err(e) => {
                tracing::debug!(port, error = %e, "inbound policy: no control plane");
                return backoff.next_pause(rand::random());
            }
        };
        let addr = picked.addr;
        let mut client = InboundServerPoliciesClient::new(picked.channel)
            .max_decoding_message_size(MAX_MESSAGE_BYTES);
        let first = async {
            let mut stream = client.watch_port(self.spec.clone()).await?.into_inner();
            let first = stream.message().await?;
            Ok::<_, tonic::Status>((stream, first))
        };
        let answer = if picked.of > 1 {
            tokio::time::timeout(self.first_answer_timeout, first)
                .await
                .unwrap_or_else(|_| Err(tonic::Status::deadline_exceeded("no first answer")))
        } else {
            first.await
        };
        let (mut stream, first) = match answer {
            Ok((stream, Some(first))) => (stream, first),
            Ok((_, None)) => return jittered(BACKOFF_MIN, rand::random()),
            Err(status)
                if matches!(
                    status.code(),
                    tonic::Code::NotFound
                        | tonic::Code::Unimplemented
                        | tonic::Code::InvalidArgument
                ) =>
            {
                // Nothing to follow here: what is in force stays.
                tracing::info!(port, control = %addr, code = ?status.code(), "the control plane serves no inbound policy for this port; the last one in force stays");
                self.controls.answered(addr);
                self.readiness.set(INBOUND_POLICY, true);
                backoff.reset();
                return jittered(NO_POLICY_RETRY, rand::random());
            }
            Err(status) => {
                tracing::debug!(port, control = %addr, error = %tether_core::truncate::for_log(status.message()), "inbound policy stream failed");
                return backoff.next_pause(rand::random());
            }
        };
        self.controls.answered(addr);
        backoff.reset();
        let mut next = Some(first);
        let mut last_refusal_log: Option<Instant> = None;
        loop {
            if let Some(server) = next.take() {
                match ServerPolicy::from_api(server) {
                    Ok(p) => {
                        if let Some(suppressed) = APPLIED_LOG.allow() {
                            tracing::info!(port, server = %p.name, suppressed, "inbound policy applied");
                        }
                        tx.send_replace(Some(Arc::new(p)));
                        self.counters.applied.inc();
                    }
                    Err(e) => {
                        self.counters.refused.inc();
                        // At most one line per 10 s per stream, however
                        // fast bad answers come.
                        if last_refusal_log.is_none_or(|t| t.elapsed() >= Duration::from_secs(10)) {
                            last_refusal_log = Some(Instant::now());
                            tracing::warn!(port, control = %addr, error = %e, "inbound policy refused; the last good one stays in force");
                        }
                    }
                }
                self.readiness.set(INBOUND_POLICY, true);
            }
            match stream.message().await {
                Ok(Some(s)) => next = Some(s),
                Ok(None) => return jittered(BACKOFF_MIN, rand::random()),
                Err(status) => {
                    tracing::debug!(port, control = %addr, error = %tether_core::truncate::for_log(status.message()), "inbound policy stream lost");
                    return backoff.next_pause(rand::random());
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use api::authn::{permit_mesh_tls, Permit, PermitMeshTls, PermitUnauthenticated};
    use linkerd2_proxy_api::http_route as route_api;

    const WEB: &str = "web.demo.serviceaccount.identity.cluster.local";
    const OTHER: &str = "batch.jobs.serviceaccount.identity.cluster.local";

    fn net(cidr: &str) -> linkerd2_proxy_api::net::IpNetwork {
        let (ip, prefix) = cidr.split_once('/').unwrap();
        (ip.parse::<IpAddr>().unwrap(), prefix.parse::<u8>().unwrap()).into()
    }

    fn labels(kind: &str, name: &str) -> HashMap<String, String> {
        HashMap::from([("kind".into(), kind.into()), ("name".into(), name.into())])
    }

    fn authz(name: &str, nets: &[(&str, &[&str])], permit: Permit) -> api::Authz {
        api::Authz {
            networks: nets
                .iter()
                .map(|(n, except)| api::Network {
                    net: Some(net(n)),
                    except: except.iter().map(|e| net(e)).collect(),
                })
                .collect(),
            authentication: Some(api::Authn {
                permit: Some(permit),
            }),
            labels: labels("authorizationpolicy", name),
            metadata: None,
        }
    }

    fn everywhere() -> &'static [(&'static str, &'static [&'static str])] {
        &[("0.0.0.0/0", &[]), ("::/0", &[])]
    }

    fn identities(exact: &[&str], suffixes: &[&[&str]]) -> Permit {
        Permit::MeshTls(PermitMeshTls {
            clients: Some(permit_mesh_tls::Clients::Identities(
                permit_mesh_tls::PermitClientIdentities {
                    identities: exact
                        .iter()
                        .map(|n| api::Identity {
                            name: n.to_string(),
                        })
                        .collect(),
                    suffixes: suffixes
                        .iter()
                        .map(|p| api::IdentitySuffix {
                            parts: p.iter().map(|s| s.to_string()).collect(),
                        })
                        .collect(),
                },
            )),
        })
    }

    fn detect(routes: Vec<api::HttpRoute>) -> api::ProxyProtocol {
        api::ProxyProtocol {
            kind: Some(api::proxy_protocol::Kind::Detect(
                api::proxy_protocol::Detect {
                    timeout: Some(prost_types::Duration {
                        seconds: 10,
                        nanos: 0,
                    }),
                    http_routes: routes,
                    http_local_rate_limit: None,
                },
            )),
        }
    }

    fn server(protocol: api::ProxyProtocol, authorizations: Vec<api::Authz>) -> api::Server {
        api::Server {
            protocol: Some(protocol),
            server_ips: vec![],
            authorizations,
            labels: labels("server", "web-http"),
        }
    }

    fn client<'a>(identity: Option<&'a str>, ip: &str) -> Client<'a> {
        Client {
            identity,
            tls: identity.is_some(),
            ip: ip.parse().unwrap(),
        }
    }

    fn allowed(d: &Decision) -> bool {
        matches!(d, Decision::Allowed { audit: false, .. })
    }

    #[test]
    fn identities_exact_and_by_suffix() {
        let s = ServerPolicy::from_api(server(
            detect(vec![]),
            vec![authz(
                "mtls",
                everywhere(),
                identities(
                    &[WEB],
                    &[&["jobs", "serviceaccount", "identity", "cluster", "local"]],
                ),
            )],
        ))
        .unwrap();
        assert_eq!(s.name, "web-http");
        assert!(!s.is_default);
        let ok = |id: Option<&str>| allowed(&s.check_connection(&client(id, "10.0.0.1")));
        assert!(ok(Some(WEB)));
        assert!(ok(Some(OTHER)));
        assert!(!ok(Some("web.demo.serviceaccount.identity.cluster.localx")));
        assert!(!ok(Some(
            "x.web.demo.serviceaccount.identity.cluster.local.evil"
        )));
        assert!(!ok(None), "no identity, no admission");
        // A TLS client without a certificate has no identity either.
        let tls_anonymous = Client {
            identity: None,
            tls: true,
            ip: "10.0.0.1".parse().unwrap(),
        };
        assert!(!allowed(&s.check_connection(&tls_anonymous)));
        let everyone = ServerPolicy::from_api(server(
            detect(vec![]),
            vec![authz("all", everywhere(), identities(&[], &[&[]]))],
        ))
        .unwrap();
        assert!(allowed(
            &everyone.check_connection(&client(Some(OTHER), "10.0.0.1"))
        ));
        assert!(!allowed(
            &everyone.check_connection(&client(None, "10.0.0.1"))
        ));
    }

    #[test]
    fn networks_with_exceptions_and_mesh_tls() {
        let s = ServerPolicy::from_api(server(
            detect(vec![]),
            vec![
                authz(
                    "cluster",
                    &[("10.0.0.0/8", &["10.9.0.0/16"])],
                    Permit::Unauthenticated(PermitUnauthenticated {}),
                ),
                authz(
                    "any-mtls",
                    &[("192.168.0.0/16", &[])],
                    Permit::MeshTls(PermitMeshTls {
                        clients: Some(permit_mesh_tls::Clients::Unauthenticated(
                            PermitUnauthenticated {},
                        )),
                    }),
                ),
            ],
        ))
        .unwrap();
        let decide = |id, ip| s.check_connection(&client(id, ip));
        assert!(matches!(
            decide(None, "10.1.2.3"),
            Decision::Allowed {
                authz: "cluster",
                ..
            }
        ));
        assert!(!allowed(&decide(None, "10.9.2.3")), "excepted");
        assert!(!allowed(&decide(None, "192.168.1.1")), "plaintext");
        assert!(matches!(
            decide(Some(OTHER), "192.168.1.1"),
            Decision::Allowed {
                authz: "any-mtls",
                ..
            }
        ));
        assert!(matches!(
            decide(Some(OTHER), "172.16.0.1"),
            Decision::Denied { route: "default" }
        ));
    }

    fn route(name: &str, path_prefix: &str, authorizations: Vec<api::Authz>) -> api::HttpRoute {
        api::HttpRoute {
            metadata: Some(meta::Metadata {
                kind: Some(meta::metadata::Kind::Resource(meta::Resource {
                    group: "policy.linkerd.io".into(),
                    kind: "HTTPRoute".into(),
                    name: name.into(),
                    ..Default::default()
                })),
            }),
            hosts: vec![],
            authorizations,
            rules: vec![api::http_route::Rule {
                matches: vec![route_api::HttpRouteMatch {
                    path: Some(route_api::PathMatch {
                        kind: Some(route_api::path_match::Kind::Prefix(path_prefix.into())),
                    }),
                    ..Default::default()
                }],
                filters: vec![],
            }],
        }
    }

    fn get(path: &str) -> http::Request<()> {
        http::Request::get(path).body(()).unwrap()
    }

    #[test]
    fn per_route_authorizations_extend_the_servers() {
        let s = ServerPolicy::from_api(server(
            detect(vec![
                route(
                    "admin",
                    "/admin",
                    vec![authz("admins", everywhere(), identities(&[WEB], &[]))],
                ),
                route("metrics", "/metrics", vec![]),
            ]),
            vec![authz("batch", everywhere(), identities(&[OTHER], &[]))],
        ))
        .unwrap();
        let decide = |path, id| s.check_request(&get(path), "web:80", &client(id, "10.0.0.1"));
        assert!(matches!(
            decide("/admin/x", Some(WEB)),
            Decision::Allowed {
                route: "admin",
                authz: "admins",
                ..
            }
        ));
        assert!(
            allowed(&decide("/admin", Some(OTHER))),
            "server's authorizations apply too"
        );
        assert!(matches!(
            decide("/metrics", Some(WEB)),
            Decision::Denied { route: "metrics" }
        ));
        assert!(matches!(decide("/other", Some(OTHER)), Decision::NoRoute));
    }

    #[test]
    fn a_path_the_app_may_read_as_a_restricted_route_is_checked_as_that_route() {
        // `/admin` only for WEB; everything else for everyone. An app (or
        // its framework) that merges slashes, resolves dot segments,
        // decodes percent-encoding, drops `;` parameters or ignores case
        // would serve `/admin` for each of these paths.
        let s = ServerPolicy::from_api(server(
            detect(vec![
                route(
                    "admin",
                    "/admin",
                    vec![authz("admins", everywhere(), identities(&[WEB], &[]))],
                ),
                route(
                    "public",
                    "/",
                    vec![authz(
                        "anyone",
                        everywhere(),
                        Permit::Unauthenticated(PermitUnauthenticated {}),
                    )],
                ),
            ]),
            vec![],
        ))
        .unwrap();
        let decide = |path, id| s.check_request(&get(path), "web:80", &client(id, "10.0.0.1"));
        for path in [
            "//admin",
            "/./admin",
            "/x/../admin",
            "/x/%2e%2e/admin",
            "/%61dmin/x",
            "/admin%2fx",
            "/admin;jsessionid=1",
            "/ADMIN",
            "/public/..%2F..%2Fadmin?q=1",
        ] {
            assert!(
                matches!(
                    decide(path, Some(OTHER)),
                    Decision::Denied { route: "admin" }
                ),
                "{path}"
            );
            assert!(allowed(&decide(path, Some(WEB))), "{path}");
        }
        for path in ["/", "/x", "/x/y/", "/adminx", "/a%20b", "/x?next=/admin"] {
            assert!(allowed(&decide(path, Some(OTHER))), "{path}");
        }
        // gRPC method names are not case-folded.
        let grpc = |path| {
            http::Request::post(path)
                .header("content-type", "application/grpc")
                .body(())
                .unwrap()
        };
        let c = client(Some(OTHER), "10.0.0.1");
        assert!(allowed(&s.check_request(&grpc("/ADMIN/Get"), "web:80", &c)));
        assert!(matches!(
            s.check_request(&grpc("//admin/Get"), "web:80", &c),
            Decision::Denied { route: "admin" }
        ));
    }

    #[test]
    fn without_routes_one_route_takes_every_request_and_opaque_checks_connections() {
        let s = ServerPolicy::from_api(server(
            detect(vec![]),
            vec![authz("batch", everywhere(), identities(&[OTHER], &[]))],
        ))
        .unwrap();
        assert!(allowed(&s.check_request(
            &get("/x"),
            "web",
            &client(Some(OTHER), "10.0.0.1")
        )));
        let opaque = ServerPolicy::from_api(server(
            api::ProxyProtocol {
                kind: Some(api::proxy_protocol::Kind::Opaque(
                    api::proxy_protocol::Opaque {},
                )),
            },
            vec![authz("batch", everywhere(), identities(&[OTHER], &[]))],
        ))
        .unwrap();
        assert!(allowed(&opaque.check_request(
            &get("/x"),
            "web",
            &client(Some(OTHER), "10.0.0.1")
        )));
        assert!(!allowed(&opaque.check_request(
            &get("/x"),
            "web",
            &client(Some(WEB), "10.0.0.1")
        )));
        let none = ServerPolicy::from_api(server(detect(vec![]), vec![])).unwrap();
        assert!(
            !allowed(&none.check_connection(&client(Some(WEB), "10.0.0.1"))),
            "no authorizations: no client"
        );
    }

    #[test]
    fn defaults_and_audit_are_named_by_labels_or_metadata() {
        let mut audit = authz(
            "ignored",
            everywhere(),
            Permit::Unauthenticated(PermitUnauthenticated {}),
        );
        audit.metadata = Some(meta::Metadata {
            kind: Some(meta::metadata::Kind::Default("audit".into())),
        });
        let mut s = server(detect(vec![]), vec![audit]);
        s.labels = labels("default", "audit");
        let s = ServerPolicy::from_api(s).unwrap();
        assert!(s.is_default);
        assert_eq!(s.name, "default:audit");
        assert!(matches!(
            s.check_connection(&client(None, "10.0.0.1")),
            Decision::Allowed {
                audit: true,
                authz: "default:audit",
                ..
            }
        ));
        // A default route is named as such, without a prefix.
        let mut routed = server(detect(vec![route("admin", "/admin", vec![])]), vec![]);
        routed.protocol = Some(detect(vec![api::HttpRoute {
            metadata: Some(meta::Metadata {
                kind: Some(meta::metadata::Kind::Default("default".into())),
            }),
            ..route("ignored", "/", vec![])
        }]));
        let routed = ServerPolicy::from_api(routed).unwrap();
        assert!(matches!(
            routed.check_request(&get("/x"), "web", &client(None, "10.0.0.1")),
            Decision::Denied { route: "default" }
        ));
        // An older control plane: `default:<name>` without a kind.
        let mut old = server(detect(vec![]), vec![]);
        old.labels = HashMap::from([("name".into(), "default:deny".into())]);
        let old = ServerPolicy::from_api(old).unwrap();
        assert!(old.is_default);
        assert_eq!(old.name, "default:deny");
    }

    #[test]
    fn answers_linkerd2_proxy_refuses_are_refused_naming_the_problem() {
        let ok = || {
            server(
                detect(vec![]),
                vec![authz("a", everywhere(), identities(&[WEB], &[]))],
            )
        };
        let refused = |s: api::Server| ServerPolicy::from_api(s).unwrap_err().to_string();
        let mut s = ok();
        s.protocol = None;
        assert!(refused(s).contains("no protocol"));
        let mut s = ok();
        s.labels.clear();
        assert!(refused(s).contains("no 'name' label"));
        let mut s = ok();
        s.authorizations[0].networks.clear();
        assert!(refused(s).contains("authorization a: no networks"));
        let mut s = ok();
        s.authorizations[0].authentication = None;
        assert!(refused(s).contains("no authentication"));
        let mut s = ok();
        s.authorizations[0].networks[0].net = Some(linkerd2_proxy_api::net::IpNetwork {
            ip: Some(IpAddr::from([10, 0, 0, 0]).into()),
            prefix_len: 33,
        });
        assert!(refused(s).contains("invalid prefix"));
        let mut s = ok();
        s.protocol = Some(api::ProxyProtocol {
            kind: Some(api::proxy_protocol::Kind::Detect(
                api::proxy_protocol::Detect {
                    timeout: None,
                    ..Default::default()
                },
            )),
        });
        assert!(refused(s).contains("detect: no timeout"));
        let mut r = route("admin", "/admin", vec![]);
        r.metadata = None;
        assert!(refused(server(detect(vec![r]), vec![])).contains("a route without metadata"));
        let mut r = route("admin", "/admin", vec![]);
        r.rules.clear();
        assert!(refused(server(detect(vec![r]), vec![])).contains("route admin: no rules"));
    }

    #[test]
    fn workloads_parse_into_linkerds_json() {
        let w: Workload = "demo/web-0".parse().unwrap();
        assert_eq!(w.spec(), r#"{"ns":"demo","pod":"web-0"}"#);
        for bad in ["demo", "/web", "demo/", "de\"mo/web", "demo/web/0"] {
            assert!(bad.parse::<Workload>().is_err(), "{bad}");
        }
    }
}
