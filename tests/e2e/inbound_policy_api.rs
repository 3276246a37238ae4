//! Conformance of the served inbound policies: a real `tether control`
//! with every policy resource in its registry, asked over gRPC the way
//! linkerd2-proxy asks (`InboundServerPolicies.WatchPort` with the
//! workload's `{"ns":..,"pod":..}`), each answer decoded with the
//! `linkerd2-proxy-api` types and put through the checks linkerd2-proxy
//! makes when it converts it (`linkerd/proxy/server-policy`: `ServerPolicy`,
//! `Authorization`, the routes and `Meta`; an answer failing them turns into
//! a policy that fails every request), then compared with what the
//! registry says.

use std::collections::BTreeSet;
use std::time::Duration;

use linkerd2_proxy_api::inbound::{
    self as api, authn, inbound_server_policies_client::InboundServerPoliciesClient,
    proxy_protocol, PortSpec, Server,
};
use linkerd2_proxy_api::meta::{metadata, Metadata};
use linkerd2_proxy_api::net::IpNetwork;

use crate::support::*;

/// What a client waits for an answer: generous, since the registry is
/// loaded before the control plane serves at all, and a change is seen at
/// the latest at the registry's rescan (5 s).
const ANSWER: Duration = Duration::from_secs(15);

const DOMAIN: &str = "cluster.local";

const SERVICES: &str = r#"
kind: Service
name: web
namespace: test
ports: [{port: 8080}, {port: 9090}, {port: 5432, opaque: true}]
endpoints:
  - {address: 127.0.0.1:7001, name: web-0, labels: {app: web, tier: front}}
  - {address: 127.0.0.1:7002, name: web-1, labels: {app: web, tier: back}}
---
kind: Service
name: api
namespace: open
ports: [{port: 8080}]
endpoints: [{address: 127.0.0.1:7003, name: api-0, labels: {app: api}}]
"#;

const POLICIES: &str = r#"
kind: Namespace
name: test
defaultInboundPolicy: deny
---
kind: Namespace
name: open
defaultInboundPolicy: all-authenticated
---
kind: Server
name: web-http
namespace: test
podSelector: {matchLabels: {app: web}, matchExpressions: [{key: tier, operator: In, values: [front]}]}
port: 8080
proxyProtocol: HTTP/1
---
kind: Server
name: web-grpc
namespace: test
podSelector: {matchLabels: {app: web}}
port: 9090
proxyProtocol: gRPC
accessPolicy: audit
---
kind: Server
name: web-db
namespace: test
podSelector: {}
port: 5432
proxyProtocol: opaque
---
kind: AuthorizationPolicy
name: web-http-clients
namespace: test
targetRef: {group: policy.linkerd.io, kind: Server, name: web-http}
requiredAuthenticationRefs:
  - {group: policy.linkerd.io, kind: MeshTLSAuthentication, name: clients}
  - {group: policy.linkerd.io, kind: NetworkAuthentication, name: internal}
---
kind: AuthorizationPolicy
name: admin-only
namespace: test
targetRef: {group: policy.linkerd.io, kind: HTTPRoute, name: web-admin}
requiredAuthenticationRefs:
  - {kind: ServiceAccount, name: admin}
  - {kind: ServiceAccount, name: ops, namespace: tools}
---
kind: AuthorizationPolicy
name: everyone-in-namespace
namespace: test
targetRef: {kind: Namespace, name: test}
requiredAuthenticationRefs:
  - {group: policy.linkerd.io, kind: NetworkAuthentication, name: internal}
---
kind: AuthorizationPolicy
name: dangling
namespace: test
targetRef: {group: policy.linkerd.io, kind: Server, name: web-http}
requiredAuthenticationRefs:
  - {group: policy.linkerd.io, kind: MeshTLSAuthentication, name: does-not-exist}
---
kind: MeshTLSAuthentication
name: clients
namespace: test
identities: ["client.test.serviceaccount.identity.cluster.local", "*.ops.serviceaccount.identity.cluster.local"]
---
kind: MeshTLSAuthentication
name: refs
namespace: test
identityRefs: [{kind: ServiceAccount, name: gw}, {kind: Namespace, name: batch}]
---
kind: NetworkAuthentication
name: internal
namespace: test
networks: [{cidr: 10.0.0.0/8, except: [10.9.0.0/16]}, {cidr: "fd00::/8"}]
---
kind: HTTPRoute
name: web-admin
namespace: test
parentRefs: [{group: policy.linkerd.io, kind: Server, name: web-http}]
rules:
  - matches: [{path: {type: PathPrefix, value: /admin}, method: POST}]
---
kind: HTTPRoute
name: web-public
namespace: test
parentRefs: [{group: policy.linkerd.io, kind: Server, name: web-http}]
rules:
  - matches: [{path: {type: Exact, value: /}}]
"#;

// === What linkerd2-proxy checks (server-policy's TryFrom conversions) ===

fn need<T>(value: Option<T>, what: &str) -> Result<T, String> {
    value.ok_or_else(|| format!("missing {what}"))
}

/// `Meta::try_new_with_default`: labels need `name`; `kind: default` is a
/// default only with an empty `group` (a missing group defaults to
/// `policy.linkerd.io`). Returns (group, kind, name) as the proxy reads it.
fn meta_of_labels(
    labels: &std::collections::HashMap<String, String>,
    default_kind: &str,
) -> Result<(String, String, String), String> {
    let name = need(labels.get("name"), "'name' label")?.clone();
    let group = labels
        .get("group")
        .cloned()
        .unwrap_or_else(|| "policy.linkerd.io".into());
    let kind = labels
        .get("kind")
        .cloned()
        .unwrap_or_else(|| default_kind.into());
    Ok((group, kind, name))
}

/// `TryFrom<Metadata> for Meta`: a kind must be set. Returns the proxy's
/// (group, kind, name).
fn meta_of(m: Option<&Metadata>) -> Result<(String, String, String), String> {
    match need(m.and_then(|m| m.kind.as_ref()), "metadata kind")? {
        metadata::Kind::Default(name) => Ok((String::new(), "default".into(), name.clone())),
        metadata::Kind::Resource(r) => Ok((r.group.clone(), r.kind.clone(), r.name.clone())),
    }
}

fn check_net(n: Option<&IpNetwork>) -> Result<String, String> {
    let n = need(n, "network")?;
    let ip = need(n.ip.as_ref(), "network address")?;
    let addr = std::net::IpAddr::try_from(*ip).map_err(|e| format!("{e:?}"))?;
    let max = if addr.is_ipv4() { 32 } else { 128 };
    if n.prefix_len > max {
        return Err(format!("prefix {} too long", n.prefix_len));
    }
    Ok(format!("{addr}/{}", n.prefix_len))
}

/// An authorization as the proxy converts it, summarised: its meta, its
/// networks (`net -except`), and who it admits.
#[derive(Debug, PartialEq, Eq, Clone)]
struct Authz {
    meta: (String, String, String),
    networks: Vec<String>,
    admits: String,
}

/// `TryFrom<api::Authz> for Authorization`.
fn check_authz(a: &api::Authz) -> Result<Authz, String> {
    if a.networks.is_empty() {
        return Err("missing networks".into());
    }
    let mut networks = Vec::new();
    for n in &a.networks {
        let mut text = check_net(n.net.as_ref())?;
        for e in &n.except {
            text.push_str(&format!(" -{}", check_net(Some(e))?));
        }
        networks.push(text);
    }
    let permit = need(
        a.authentication.as_ref().and_then(|a| a.permit.as_ref()),
        "authentications",
    )?;
    let admits = match permit {
        authn::Permit::Unauthenticated(_) => "unauthenticated".to_string(),
        authn::Permit::MeshTls(m) => match need(m.clients.as_ref(), "authentications")? {
            authn::permit_mesh_tls::Clients::Unauthenticated(_) => "tls".to_string(),
            authn::permit_mesh_tls::Clients::Identities(ids) => {
                let mut names: Vec<String> =
                    ids.identities.iter().map(|i| i.name.clone()).collect();
                // Suffix::from(parts): "" for no parts, else ".a.b".
                names.extend(ids.suffixes.iter().map(|s| {
                    if s.parts.is_empty() {
                        "*".to_string()
                    } else {
                        format!("*.{}", s.parts.join("."))
                    }
                }));
                format!("mtls {}", names.join(" "))
            }
        },
    };
    let meta = match &a.metadata {
        Some(m) => meta_of(Some(m))?,
        None => meta_of_labels(&a.labels, "serverauthorization")?,
    };
    // Labels are still read by older proxies: they must say the same.
    let from_labels = meta_of_labels(&a.labels, "serverauthorization")?;
    if from_labels.2 != meta.2 {
        return Err(format!(
            "labels {from_labels:?} and metadata {meta:?} disagree"
        ));
    }
    Ok(Authz {
        meta,
        networks,
        admits,
    })
}

/// A route as the proxy converts it: its meta, its own authorizations
/// (the proxy adds the server's after them), and one line per rule.
#[derive(Debug)]
struct RouteView {
    meta: (String, String, String),
    authzs: Vec<Authz>,
    rules: Vec<String>,
}

fn check_http_route(r: &api::HttpRoute) -> Result<RouteView, String> {
    use linkerd2_proxy_api::http_route::path_match;
    let meta = meta_of(r.metadata.as_ref())?;
    let authzs = r
        .authorizations
        .iter()
        .map(check_authz)
        .collect::<Result<_, _>>()?;
    if r.rules.is_empty() {
        return Err("a route without rules".into());
    }
    let mut rules = Vec::new();
    for rule in &r.rules {
        let mut text = Vec::new();
        for m in &rule.matches {
            let path = match m.path.as_ref() {
                None => "any".to_string(),
                Some(p) => match need(p.kind.as_ref(), "path match kind")? {
                    path_match::Kind::Exact(e) => format!("={e}"),
                    path_match::Kind::Prefix(p) => format!("{p}*"),
                    path_match::Kind::Regex(r) => format!("~{r}"),
                },
            };
            let method = match m.method.as_ref() {
                None => String::new(),
                Some(m) => format!(" {:?}", need(m.r#type.as_ref(), "method type")?),
            };
            text.push(format!("{path}{method}"));
        }
        for f in &rule.filters {
            need(f.kind.as_ref(), "filter kind")?;
        }
        rules.push(text.join(","));
    }
    Ok(RouteView {
        meta,
        authzs,
        rules,
    })
}

fn check_grpc_route(r: &api::GrpcRoute) -> Result<RouteView, String> {
    let meta = meta_of(r.metadata.as_ref())?;
    let authzs = r
        .authorizations
        .iter()
        .map(check_authz)
        .collect::<Result<_, _>>()?;
    if r.rules.is_empty() {
        return Err("a route without rules".into());
    }
    // linkerd2-proxy: `pb.rpc.ok_or(InvalidRouteMatch::MissingRpc)`.
    if r.rules
        .iter()
        .flat_map(|rule| &rule.matches)
        .any(|m| m.rpc.is_none())
    {
        return Err("a gRPC route match without an RPC match".into());
    }
    let rules = r
        .rules
        .iter()
        .map(|rule| format!("{} matches", rule.matches.len()))
        .collect();
    Ok(RouteView {
        meta,
        authzs,
        rules,
    })
}

/// A server as the proxy converts it.
#[derive(Debug)]
struct ServerView {
    meta: (String, String, String),
    protocol: &'static str,
    authzs: Vec<Authz>,
    routes: Vec<RouteView>,
}

/// `TryFrom<api::Server> for ServerPolicy`.
fn check_server(s: &Server) -> Result<ServerView, String> {
    let kind = need(
        s.protocol.as_ref().and_then(|p| p.kind.as_ref()),
        "proxy protocol",
    )?;
    let authzs = s
        .authorizations
        .iter()
        .map(check_authz)
        .collect::<Result<Vec<_>, _>>()?;
    let http = |routes: &[api::HttpRoute]| {
        routes
            .iter()
            .map(check_http_route)
            .collect::<Result<Vec<_>, _>>()
    };
    let (protocol, routes) = match kind {
        proxy_protocol::Kind::Detect(d) => {
            let t = need(d.timeout.as_ref(), "protocol detection timeout")?;
            Duration::try_from(*t).map_err(|e| format!("invalid detection timeout: {e}"))?;
            ("detect", http(&d.http_routes)?)
        }
        proxy_protocol::Kind::Http1(h) => ("http1", http(&h.routes)?),
        proxy_protocol::Kind::Http2(h) => ("http2", http(&h.routes)?),
        proxy_protocol::Kind::Grpc(g) => (
            "grpc",
            g.routes
                .iter()
                .map(check_grpc_route)
                .collect::<Result<Vec<_>, _>>()?,
        ),
        proxy_protocol::Kind::Opaque(_) => ("opaque", vec![]),
        proxy_protocol::Kind::Tls(_) => ("tls", vec![]),
    };
    Ok(ServerView {
        meta: meta_of_labels(&s.labels, "server")?,
        protocol,
        authzs,
        routes,
    })
}

// === Helpers ===

fn workload(ns: &str, pod: &str) -> String {
    format!(r#"{{"ns":"{ns}","pod":"{pod}"}}"#)
}

async fn watch(
    client: &mut InboundServerPoliciesClient<tonic::transport::Channel>,
    workload: &str,
    port: u32,
) -> (ServerView, tonic::Streaming<Server>) {
    let spec = PortSpec {
        workload: workload.to_string(),
        port,
    };
    let mut stream = tokio::time::timeout(ANSWER, client.watch_port(spec.clone()))
        .await
        .expect("an answer")
        .unwrap_or_else(|s| panic!("{spec:?}: {s:?}"))
        .into_inner();
    let server = tokio::time::timeout(ANSWER, stream.message())
        .await
        .expect("a first policy")
        .unwrap()
        .unwrap();
    let view = check_server(&server).unwrap_or_else(|e| panic!("{spec:?}: {e}: {server:#?}"));
    (view, stream)
}

async fn next(stream: &mut tonic::Streaming<Server>, why: &str) -> ServerView {
    let server = tokio::time::timeout(ANSWER, stream.message())
        .await
        .unwrap_or_else(|_| panic!("a new policy after {why}"))
        .unwrap()
        .unwrap();
    check_server(&server).unwrap_or_else(|e| panic!("{why}: {e}: {server:#?}"))
}

fn meta(group: &str, kind: &str, name: &str) -> (String, String, String) {
    (group.into(), kind.into(), name.into())
}

fn default_authz(policy: &str, networks: &[&str], admits: &str) -> Authz {
    Authz {
        meta: meta("", "default", policy),
        networks: networks.iter().map(|s| s.to_string()).collect(),
        admits: admits.into(),
    }
}

const ALL: [&str; 2] = ["0.0.0.0/0", "::/0"];
const INTERNAL: [&str; 2] = ["10.0.0.0/8 -10.9.0.0/16", "fd00::/8"];

fn policy_authz(name: &str, networks: &[&str], admits: &str) -> Authz {
    Authz {
        meta: meta("policy.linkerd.io", "AuthorizationPolicy", name),
        networks: networks.iter().map(|s| s.to_string()).collect(),
        admits: admits.into(),
    }
}

async fn control_with_policies(scratch: &Scratch) -> (Process, String) {
    scratch.write("services.yaml", SERVICES);
    scratch.write("policies.yaml", POLICIES);
    let control = scratch
        .control_at(
            "control",
            "127.0.0.1:0",
            &[
                "--insecure-control-plane",
                "--default-inbound-policy",
                "cluster-authenticated",
                "--cluster-networks",
                "10.0.0.0/8,fd00::/8",
            ],
        )
        .await;
    let url = format!("http://{}", control.addr("grpc"));
    (control, url)
}

// === The tests ===

#[tokio::test]
async fn every_answer_is_one_linkerd2_proxy_accepts_and_says_what_the_registry_says() {
    let scratch = Scratch::new();
    let (_control, url) = control_with_policies(&scratch).await;
    let mut client = InboundServerPoliciesClient::connect(url).await.unwrap();
    let id = |sa: &str, ns: &str| format!("{sa}.{ns}.serviceaccount.identity.{DOMAIN}");

    // web-0 (app=web, tier=front) on 8080: the HTTP/1 server, its policies
    // (the one naming a missing authentication admits nobody and is left
    // out; the namespace-wide one applies), its two routes, one with its
    // own authorization.
    let (web, _s) = watch(&mut client, &workload("test", "web-0"), 8080).await;
    assert_eq!(web.meta, meta("policy.linkerd.io", "server", "web-http"));
    assert_eq!(web.protocol, "http1");
    assert_eq!(
        web.authzs,
        vec![
            policy_authz("everyone-in-namespace", &INTERNAL, "unauthenticated"),
            policy_authz(
                "web-http-clients",
                &INTERNAL,
                &format!(
                    "mtls {} *.ops.serviceaccount.identity.{DOMAIN}",
                    id("client", "test")
                )
            ),
        ]
    );
    assert_eq!(web.routes.len(), 2, "{:?}", web.routes);
    let admin = &web.routes[0];
    assert_eq!(
        admin.meta,
        meta("policy.linkerd.io", "HTTPRoute", "web-admin")
    );
    assert_eq!(admin.rules, vec!["/admin* Registered(Post)".to_string()]);
    assert_eq!(
        admin.authzs,
        vec![policy_authz(
            "admin-only",
            &ALL,
            &format!("mtls {} {}", id("admin", "test"), id("ops", "tools"))
        )]
    );
    let public = &web.routes[1];
    assert_eq!(
        public.meta,
        meta("policy.linkerd.io", "HTTPRoute", "web-public")
    );
    assert_eq!(public.rules, vec!["=/".to_string()]);
    assert!(public.authzs.is_empty());

    // The older `ns:pod` form names the same workload.
    let (old_form, _s) = watch(&mut client, "test:web-0", 8080).await;
    assert_eq!(old_form.meta, web.meta);

    // web-1 (tier=back) is not selected on 8080: the namespace's default.
    let (web1, _s) = watch(&mut client, &workload("test", "web-1"), 8080).await;
    assert_eq!(web1.meta, meta("", "default", "deny"));
    assert_eq!(web1.protocol, "detect");
    assert!(web1.authzs.is_empty(), "deny admits nobody");
    assert_eq!(web1.routes.len(), 1);
    assert_eq!(web1.routes[0].meta, meta("", "default", "default"));

    // gRPC with accessPolicy audit: the namespace-wide policy, then audit
    // last, and the default gRPC route.
    let (grpc, _s) = watch(&mut client, &workload("test", "web-1"), 9090).await;
    assert_eq!(grpc.meta, meta("policy.linkerd.io", "server", "web-grpc"));
    assert_eq!(grpc.protocol, "grpc");
    assert_eq!(
        grpc.authzs,
        vec![
            policy_authz("everyone-in-namespace", &INTERNAL, "unauthenticated"),
            default_authz("audit", &ALL, "unauthenticated"),
        ]
    );
    assert_eq!(grpc.routes.len(), 1);
    assert_eq!(grpc.routes[0].meta, meta("", "default", "default"));

    // Opaque, selecting every workload of the namespace.
    let (db, _s) = watch(&mut client, &workload("test", "web-0"), 5432).await;
    assert_eq!((db.protocol, db.meta.2.as_str()), ("opaque", "web-db"));

    // Another namespace's default.
    let (api, _s) = watch(&mut client, &workload("open", "api-0"), 8080).await;
    assert_eq!(api.meta, meta("", "default", "all-authenticated"));
    assert_eq!(
        api.authzs,
        vec![default_authz("all-authenticated", &ALL, "mtls *")]
    );

    // No namespace default, an unknown workload, garbage: the control
    // plane's default, never an error (a stock proxy would fail every
    // inbound connection).
    for w in [
        workload("elsewhere", "x-0"),
        "not a workload".to_string(),
        "{\"ns\": 5}".to_string(),
        "x".repeat(100_000),
    ] {
        let (d, _s) = watch(&mut client, &w, 8080).await;
        assert_eq!(
            d.meta,
            meta("", "default", "cluster-authenticated"),
            "{w:.40}"
        );
        assert_eq!(
            d.authzs,
            vec![default_authz(
                "cluster-authenticated",
                &["10.0.0.0/8", "fd00::/8"],
                "mtls *"
            )]
        );
    }

    // GetPort answers the same as the watch's first message.
    let got = client
        .get_port(PortSpec {
            workload: workload("test", "web-0"),
            port: 8080,
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(check_server(&got).unwrap().authzs, web.authzs);

    // Port 0 is a bad request.
    let err = client
        .get_port(PortSpec {
            workload: workload("test", "web-0"),
            port: 0,
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument);
}

#[tokio::test]
async fn a_watch_follows_policy_and_workload_changes() {
    let scratch = Scratch::new();
    let (_control, url) = control_with_policies(&scratch).await;
    let mut client = InboundServerPoliciesClient::connect(url).await.unwrap();
    let (first, mut stream) = watch(&mut client, &workload("test", "web-0"), 8080).await;
    assert_eq!(first.authzs.len(), 2);

    // An authentication's identities change.
    scratch.write(
        "policies.yaml",
        &POLICIES.replace("\"client.test.", "\"client2.test."),
    );
    let changed = next(&mut stream, "the identities changed").await;
    let clients: BTreeSet<String> = changed.authzs.iter().map(|a| a.admits.clone()).collect();
    assert!(
        clients.iter().any(|a| a.contains("client2.test.")),
        "{clients:?}"
    );

    // A bad file changes nothing: the last good policy stays in force, and
    // the next good change still arrives.
    scratch.write(
        "policies.yaml",
        &format!("{POLICIES}---\nkind: Server\nname: Bad\n"),
    );
    scratch.write(
        "services.yaml",
        &SERVICES.replace(
            "labels: {app: web, tier: front}",
            "labels: {app: web, tier: back}",
        ),
    );
    // The workload's labels no longer match the server: the namespace's
    // default (deny) applies.
    let moved = next(&mut stream, "the workload's labels changed").await;
    assert_eq!(moved.meta, meta("", "default", "deny"));
    assert!(moved.authzs.is_empty());
}
