//! The Kubernetes registry against a local test API server.
//!
//! The server here is a stand-in for a real Kubernetes API server, not one.
//! It speaks the real list/watch protocol for Services, EndpointSlices and
//! Pods: JSON of real Kubernetes objects (k8s-openapi types), list
//! responses with a resourceVersion, watch streams of ADDED/MODIFIED/
//! DELETED events resuming from a resourceVersion, BOOKMARK events, a watch
//! that is dropped by the server, and `410 Gone` (an ERROR event with code
//! 410, "Expired") for a resourceVersion older than its compaction point.
//! It does not do authentication, field/label selectors, pagination
//! beyond one page, or server-side apply.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, StreamBody};
use hyper::body::Frame;
use hyper_util::rt::{TokioExecutor, TokioIo};
use k8s_openapi::api::core::v1::{
    Container, ObjectReference, Pod, PodSpec, Service, ServicePort, ServiceSpec,
};
use k8s_openapi::api::discovery::v1::{Endpoint, EndpointConditions, EndpointPort, EndpointSlice};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use tether_control::index::{Index, SlotKey};
use tether_control::metrics::ControlMetrics;
use tether_control::registry::kubernetes::{KubernetesRegistry, WatchLag};
use tether_control::registry::Registry;
use tether_core::authority::ServiceKey;
use tokio::sync::Notify;

const SERVICES: &str = "/api/v1/services";
const SLICES: &str = "/apis/discovery.k8s.io/v1/endpointslices";
const PODS: &str = "/api/v1/pods";
const HTTPROUTES: &str = "/apis/gateway.networking.k8s.io/v1/httproutes";
const GRPCROUTES: &str = "/apis/gateway.networking.k8s.io/v1/grpcroutes";
const SERVERS: &str = "/apis/policy.linkerd.io/v1beta3/servers";
const AUTHORIZATION_POLICIES: &str = "/apis/policy.linkerd.io/v1alpha1/authorizationpolicies";
const MESH_TLS: &str = "/apis/policy.linkerd.io/v1alpha1/meshtlsauthentications";
const NETWORK_AUTHNS: &str = "/apis/policy.linkerd.io/v1alpha1/networkauthentications";
const POLICY_HTTPROUTES: &str = "/apis/policy.linkerd.io/v1beta3/httproutes";
const NAMESPACES: &str = "/api/v1/namespaces";
const TOKEN_REVIEWS: &str = "/apis/authentication.k8s.io/v1/tokenreviews";

#[derive(Default)]
struct State {
    rv: u64,
    objects: BTreeMap<&'static str, BTreeMap<String, serde_json::Value>>,
    events: Vec<(u64, &'static str, &'static str, serde_json::Value)>,
    /// Watches from before this resourceVersion get 410 Gone.
    compacted: u64,
    /// Bumped to drop every open watch.
    generation: u64,
    bookmarks_requested: bool,
    /// How many watches were answered 410 Gone.
    gone: u64,
    /// How many list requests were served.
    lists: u64,
}

#[derive(Clone, Default)]
struct ApiServer {
    state: Arc<Mutex<State>>,
    changed: Arc<Notify>,
    /// Holds the first Pod list until `release_pods`, to see that loading
    /// waits for it; `pods_held` says the list is being held.
    hold_pods: Arc<AtomicBool>,
    pods_held: Arc<AtomicBool>,
    release_pods: Arc<Notify>,
    /// Whether the Gateway API CRDs are installed (404 for routes if not).
    routes_installed: Arc<AtomicBool>,
    /// Whether Linkerd's policy CRDs are installed and Namespaces listable.
    policies_installed: Arc<AtomicBool>,
}

fn list_kind(path: &str) -> (&'static str, &'static str, &'static str) {
    match path {
        SERVICES => ("v1", "ServiceList", "Service"),
        SLICES => ("discovery.k8s.io/v1", "EndpointSliceList", "EndpointSlice"),
        HTTPROUTES => ("gateway.networking.k8s.io/v1", "HTTPRouteList", "HTTPRoute"),
        GRPCROUTES => ("gateway.networking.k8s.io/v1", "GRPCRouteList", "GRPCRoute"),
        SERVERS => ("policy.linkerd.io/v1beta3", "ServerList", "Server"),
        AUTHORIZATION_POLICIES => (
            "policy.linkerd.io/v1alpha1",
            "AuthorizationPolicyList",
            "AuthorizationPolicy",
        ),
        MESH_TLS => (
            "policy.linkerd.io/v1alpha1",
            "MeshTLSAuthenticationList",
            "MeshTLSAuthentication",
        ),
        NETWORK_AUTHNS => (
            "policy.linkerd.io/v1alpha1",
            "NetworkAuthenticationList",
            "NetworkAuthentication",
        ),
        POLICY_HTTPROUTES => ("policy.linkerd.io/v1beta3", "HTTPRouteList", "HTTPRoute"),
        NAMESPACES => ("v1", "NamespaceList", "Namespace"),
        _ => ("v1", "PodList", "Pod"),
    }
}

impl ApiServer {
    fn upsert(&self, path: &'static str, object: impl serde::Serialize) {
        let mut v = serde_json::to_value(object).unwrap();
        let mut s = self.state.lock().unwrap();
        s.rv += 1;
        let rv = s.rv;
        v["metadata"]["resourceVersion"] = rv.to_string().into();
        let key = format!(
            "{}/{}",
            v["metadata"]["namespace"].as_str().unwrap_or(""),
            v["metadata"]["name"].as_str().unwrap()
        );
        let existed = s
            .objects
            .entry(path)
            .or_default()
            .insert(key, v.clone())
            .is_some();
        s.events
            .push((rv, path, if existed { "MODIFIED" } else { "ADDED" }, v));
        drop(s);
        self.changed.notify_waiters();
    }

    /// Drops every watch and forgets history: old resourceVersions are gone.
    fn compact_and_drop(&self) {
        let mut s = self.state.lock().unwrap();
        s.compacted = s.rv + 1;
        s.generation += 1;
        drop(s);
        self.changed.notify_waiters();
    }

    async fn serve(self, listener: tokio::net::TcpListener) {
        while let Ok((stream, _)) = listener.accept().await {
            let this = self.clone();
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(move |req| {
                    let this = this.clone();
                    async move { Ok::<_, Infallible>(this.handle(req).await) }
                });
                let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(stream), svc)
                    .await;
            });
        }
    }

    async fn handle(
        &self,
        req: http::Request<hyper::body::Incoming>,
    ) -> http::Response<http_body_util::combinators::BoxBody<Bytes, Infallible>> {
        if req.uri().path() == TOKEN_REVIEWS && req.method() == http::Method::POST {
            let body = req
                .into_body()
                .collect()
                .await
                .map(|b| b.to_bytes())
                .unwrap_or_default();
            let review: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
            let token = review["spec"]["token"].as_str().unwrap_or("");
            let status = match token {
                "sa-token-web" => serde_json::json!({"authenticated": true,
                    "user": {"username": "system:serviceaccount:demo:web"}, "audiences": ["tether.io"]}),
                "sa-token-other-audience" => serde_json::json!({"authenticated": true,
                    "user": {"username": "system:serviceaccount:demo:web"}, "audiences": ["vault"]}),
                _ => serde_json::json!({"authenticated": false, "error": "invalid bearer token"}),
            };
            let mut answer = review.clone();
            answer["status"] = status;
            return http::Response::builder()
                .status(201)
                .header("content-type", "application/json")
                .body(http_body_util::Full::new(Bytes::from(answer.to_string())).boxed())
                .unwrap();
        }
        let path: &'static str = match req.uri().path() {
            SERVICES => SERVICES,
            SLICES => SLICES,
            PODS => PODS,
            HTTPROUTES if self.routes_installed.load(Ordering::SeqCst) => HTTPROUTES,
            GRPCROUTES if self.routes_installed.load(Ordering::SeqCst) => GRPCROUTES,
            path if self.policies_installed.load(Ordering::SeqCst)
                && [
                    SERVERS,
                    AUTHORIZATION_POLICIES,
                    MESH_TLS,
                    NETWORK_AUTHNS,
                    POLICY_HTTPROUTES,
                    NAMESPACES,
                ]
                .contains(&path) =>
            {
                [
                    SERVERS,
                    AUTHORIZATION_POLICIES,
                    MESH_TLS,
                    NETWORK_AUTHNS,
                    POLICY_HTTPROUTES,
                    NAMESPACES,
                ]
                .into_iter()
                .find(|p| *p == path)
                .unwrap()
            }
            other => {
                let body = format!("{{\"kind\":\"Status\",\"apiVersion\":\"v1\",\"status\":\"Failure\",\"message\":\"no {other}\",\"code\":404}}");
                return http::Response::builder()
                    .status(404)
                    .body(http_body_util::Full::new(Bytes::from(body)).boxed())
                    .unwrap();
            }
        };
        let query: BTreeMap<String, String> = req
            .uri()
            .query()
            .unwrap_or("")
            .split('&')
            .filter_map(|kv| {
                kv.split_once('=')
                    .map(|(k, v)| (k.to_string(), v.to_string()))
            })
            .collect();
        let (api_version, list, kind) = list_kind(path);
        if query.get("watch").map(String::as_str) != Some("true") {
            if path == PODS && self.hold_pods.swap(false, Ordering::SeqCst) {
                self.pods_held.store(true, Ordering::SeqCst);
                self.release_pods.notified().await;
            }
            let mut s = self.state.lock().unwrap();
            s.lists += 1;
            let items: Vec<_> = s
                .objects
                .get(path)
                .map(|m| m.values().cloned().collect())
                .unwrap_or_default();
            let body = serde_json::json!({
                "apiVersion": api_version, "kind": list,
                "metadata": {"resourceVersion": s.rv.to_string()},
                "items": items,
            });
            return http::Response::builder()
                .header("content-type", "application/json")
                .body(http_body_util::Full::new(Bytes::from(body.to_string())).boxed())
                .unwrap();
        }
        // A watch: stream events after the given resourceVersion.
        let from: u64 = query
            .get("resourceVersion")
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        let (tx, rx) = tokio::sync::mpsc::channel::<Result<Frame<Bytes>, Infallible>>(64);
        let this = self.clone();
        let line = |v: serde_json::Value| Ok(Frame::data(Bytes::from(format!("{v}\n"))));
        // Read under the lock of the 410 check: a drop between the two
        // would leave this watch open past it.
        let generation = {
            let mut s = this.state.lock().unwrap();
            s.bookmarks_requested |=
                query.get("allowWatchBookmarks").map(String::as_str) == Some("true");
            if from < s.compacted {
                s.gone += 1;
                let gone = serde_json::json!({"type": "ERROR", "object": {
                    "kind": "Status", "apiVersion": "v1", "status": "Failure",
                    "message": format!("too old resource version: {from}"), "reason": "Expired", "code": 410,
                }});
                let _ = tx.try_send(line(gone));
                drop(tx);
                return http::Response::builder()
                    .header("content-type", "application/json")
                    .body(StreamBody::new(tokio_stream::wrappers::ReceiverStream::new(rx)).boxed())
                    .unwrap();
            }
            s.generation
        };
        tokio::spawn(async move {
            let mut sent = from;
            let mut bookmark = tokio::time::interval(Duration::from_millis(200));
            loop {
                let (pending, gen, rv): (Vec<_>, u64, u64) = {
                    let s = this.state.lock().unwrap();
                    let pending = s
                        .events
                        .iter()
                        .filter(|(rv, p, _, _)| *p == path && *rv > sent)
                        .map(|(rv, _, t, o)| (*rv, *t, o.clone()))
                        .collect();
                    (pending, s.generation, s.rv)
                };
                if gen != generation {
                    return; // the server drops this watch
                }
                for (rv, t, o) in pending {
                    if tx
                        .send(line(serde_json::json!({"type": t, "object": o})))
                        .await
                        .is_err()
                    {
                        return;
                    }
                    sent = rv;
                }
                tokio::select! {
                    _ = this.changed.notified() => {}
                    _ = bookmark.tick() => {
                        let mark = serde_json::json!({"type": "BOOKMARK", "object": {
                            "apiVersion": api_version, "kind": kind, "metadata": {"resourceVersion": rv.to_string()},
                        }});
                        if tx.send(line(mark)).await.is_err() {
                            return;
                        }
                        sent = sent.max(rv);
                    }
                }
            }
        });
        http::Response::builder()
            .header("content-type", "application/json")
            .body(StreamBody::new(tokio_stream::wrappers::ReceiverStream::new(rx)).boxed())
            .unwrap()
    }
}

fn meta(name: &str) -> ObjectMeta {
    ObjectMeta {
        name: Some(name.into()),
        namespace: Some("demo".into()),
        ..Default::default()
    }
}

fn service() -> Service {
    let mut m = meta("web");
    m.annotations = Some(BTreeMap::from([
        ("tether.io/global-id".to_string(), "web-global".to_string()),
        ("tether.io/opaque-ports".to_string(), "5432".to_string()),
        (
            "tether.io/multicluster-mode".to_string(),
            "failover".to_string(),
        ),
        ("tether.io/retry-budget".to_string(), "0.5/3".to_string()),
    ]));
    Service {
        metadata: m,
        spec: Some(ServiceSpec {
            cluster_ip: Some("10.96.0.10".into()),
            ports: Some(vec![
                ServicePort {
                    name: Some("http".into()),
                    port: 80,
                    ..Default::default()
                },
                ServicePort {
                    name: Some("db".into()),
                    port: 5432,
                    ..Default::default()
                },
            ]),
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn pod(name: &str) -> Pod {
    Pod {
        metadata: meta(name),
        spec: Some(PodSpec {
            service_account_name: Some("web".into()),
            containers: vec![
                Container {
                    name: "app".into(),
                    ..Default::default()
                },
                Container {
                    name: "tether-proxy".into(),
                    ..Default::default()
                },
            ],
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn slice(endpoints: &[(&str, &str, bool)]) -> EndpointSlice {
    let mut m = meta("web-abcde");
    // Changed now: the watch lag is measured from here.
    m.creation_timestamp = Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
        k8s_openapi::jiff::Timestamp::now(),
    ));
    m.labels = Some(BTreeMap::from([(
        "kubernetes.io/service-name".to_string(),
        "web".to_string(),
    )]));
    EndpointSlice {
        metadata: m,
        address_type: "IPv4".into(),
        endpoints: Some(
            endpoints
                .iter()
                .map(|(ip, pod, ready)| Endpoint {
                    addresses: vec![ip.to_string()],
                    conditions: Some(EndpointConditions {
                        ready: Some(*ready),
                        ..Default::default()
                    }),
                    target_ref: Some(ObjectReference {
                        kind: Some("Pod".into()),
                        name: Some(pod.to_string()),
                        namespace: Some("demo".into()),
                        ..Default::default()
                    }),
                    zone: Some("zone-a".into()),
                    ..Default::default()
                })
                .collect(),
        ),
        ports: Some(vec![EndpointPort {
            name: Some("http".into()),
            port: Some(8080),
            ..Default::default()
        }]),
    }
}

async fn eventually(check: impl FnMut() -> bool) -> bool {
    eventually_within(Duration::from_secs(10), check).await
}

async fn eventually_within(limit: Duration, mut check: impl FnMut() -> bool) -> bool {
    for _ in 0..limit.as_millis() / 50 {
        if check() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    false
}

#[tokio::test]
async fn watches_services_slices_and_pods_through_gone_and_dropped_watches() {
    let api = ApiServer::default();
    api.upsert(SERVICES, service());
    api.upsert(PODS, pod("web-0"));
    api.upsert(PODS, pod("web-1"));
    api.upsert(SLICES, slice(&[("10.1.0.5", "web-0", true)]));
    api.hold_pods.store(true, Ordering::SeqCst);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(api.clone().serve(listener));

    let metrics = ControlMetrics::default();
    let index = Index::new(metrics.clone());
    let client = kube::Client::try_from(kube::Config::new(url.parse().unwrap())).unwrap();
    let lag = WatchLag::new_with_constructor(tether_control::metrics::LatencyBuckets);
    let registry = KubernetesRegistry::new(client, "cluster.local", metrics.clone(), lag.clone());
    let loaded = Arc::new(AtomicBool::new(false));
    let flag = loaded.clone();
    tokio::spawn(registry.run(
        index.clone(),
        Box::new(move || flag.store(true, Ordering::SeqCst)),
    ));

    // Not loaded while one kind (Pods) has not been listed yet, though the
    // other two have.
    assert!(
        eventually(|| api.pods_held.load(Ordering::SeqCst) && api.state.lock().unwrap().lists >= 2)
            .await,
        "the lists never came"
    );
    assert!(
        !loaded.load(Ordering::SeqCst),
        "loaded before the first full sync"
    );
    api.release_pods.notify_one();
    assert!(
        eventually(|| loaded.load(Ordering::SeqCst)).await,
        "never loaded"
    );

    let key = SlotKey::Service(ServiceKey::new("web", "demo"));
    let snap = index.snapshot(&key, 80);
    let ep = snap
        .endpoints
        .get(&"10.1.0.5:8080".parse().unwrap())
        .expect("the endpoint");
    assert_eq!(
        ep.identity.as_deref(),
        Some("web.demo.serviceaccount.identity.cluster.local")
    );
    assert!(ep.meshed);
    assert_eq!(ep.zone.as_deref(), Some("zone-a"));
    let state = index.service(&ServiceKey::new("web", "demo")).unwrap();
    assert_eq!(state.global_id.as_deref(), Some("web-global"));
    assert_eq!(state.cluster_ip, Some("10.96.0.10".parse().unwrap()));
    // The other annotations.
    assert_eq!(
        state.mode,
        Some(tether_core::registry::MulticlusterMode::Failover)
    );
    assert_eq!(
        state.retry_budget,
        Some(tether_core::registry::RetryBudget {
            ratio: 0.5,
            min_per_second: 3
        })
    );
    let opaque: BTreeMap<u16, bool> = state.ports.iter().map(|p| (p.port, p.opaque)).collect();
    assert_eq!(opaque, BTreeMap::from([(80, false), (5432, true)]));
    let watch_lag = |kind: &str| {
        let mut registry = prometheus_client::registry::Registry::default();
        registry.register("lag", "", lag.clone());
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        let samples = tether_core::prom::parse(&text);
        let get = |name: &str| {
            samples
                .iter()
                .find(|s| s.name == name && s.label("kind") == Some(kind))
                .map_or(0.0, |s| s.value)
        };
        (get("lag_count"), get("lag_sum"))
    };
    assert_eq!(
        watch_lag("EndpointSlice").0,
        0.0,
        "a list is not a live change"
    );

    // A change arrives through the watch; readiness comes from conditions.
    api.upsert(
        SLICES,
        slice(&[("10.1.0.5", "web-0", true), ("10.1.0.6", "web-1", false)]),
    );
    assert!(
        eventually(|| index
            .service(&ServiceKey::new("web", "demo"))
            .is_some_and(|s| s.endpoints.len() == 2))
        .await
    );
    assert_eq!(
        index.snapshot(&key, 80).endpoints.len(),
        1,
        "a not-ready endpoint is not served"
    );
    api.upsert(
        SLICES,
        slice(&[("10.1.0.5", "web-0", true), ("10.1.0.6", "web-1", true)]),
    );
    assert!(eventually(|| index.snapshot(&key, 80).endpoints.len() == 2).await);
    // Live changes are measured from their change time to their arrival.
    let (count, sum) = watch_lag("EndpointSlice");
    assert!(count >= 2.0, "watch lag observed {count} times");
    assert!((0.0..60.0).contains(&sum), "watch lag sum {sum} s");

    // The server drops every watch and compacts its history; meanwhile the
    // endpoint set changes. Resuming fails with 410 Gone, the watcher
    // relists, and the index converges.
    api.compact_and_drop();
    api.upsert(SLICES, slice(&[("10.1.0.6", "web-1", true)]));
    assert!(
        eventually(|| {
            let s = index.snapshot(&key, 80);
            s.endpoints.len() == 1 && s.endpoints.contains_key(&"10.1.0.6:8080".parse().unwrap())
        })
        .await,
        "the registry did not converge after a dropped watch and 410 Gone"
    );
    let s = api.state.lock().unwrap();
    assert!(s.bookmarks_requested, "watches did not ask for bookmarks");
    assert!(s.gone >= 1, "no watch was answered 410 Gone");
    assert!(s.lists >= 4, "no relist after 410 Gone ({} lists)", s.lists);
}

fn http_route(name: &str, weight: u32) -> serde_json::Value {
    serde_json::json!({
        "apiVersion": "gateway.networking.k8s.io/v1", "kind": "HTTPRoute",
        "metadata": {"name": name, "namespace": "demo"},
        "spec": {
            // A Gateway parent (not the mesh's) beside the Service.
            "parentRefs": [{"name": "edge"}, {"group": "", "kind": "Service", "name": "web", "port": 80}],
            "hostnames": ["web.example.com"],
            "rules": [{
                // The API server's defaults, as a cluster stores them.
                "matches": [{"path": {"type": "PathPrefix", "value": "/"}}],
                "backendRefs": [
                    {"group": "", "kind": "Service", "name": "web", "port": 80, "weight": 100 - weight},
                    {"group": "", "kind": "Service", "name": "web-v2", "port": 80, "weight": weight},
                ],
            }],
        },
    })
}

fn canary_weight(index: &Index) -> Option<u32> {
    let state = index.service(&ServiceKey::new("web", "demo"))?;
    match state.routes.first()? {
        tether_core::route::Route::Http(r) => Some(r.rules[0].backend_refs[1].weight),
        tether_core::route::Route::Grpc(_) => None,
    }
}

/// A Kubernetes registry over `api`, once loaded: its index and metrics.
async fn loaded_registry(api: &ApiServer) -> (Index, ControlMetrics) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(api.clone().serve(listener));
    let metrics = ControlMetrics::default();
    let index = Index::new(metrics.clone());
    let client = kube::Client::try_from(kube::Config::new(url.parse().unwrap())).unwrap();
    let lag = WatchLag::new_with_constructor(tether_control::metrics::LatencyBuckets);
    let registry = KubernetesRegistry::new(client, "cluster.local", metrics.clone(), lag);
    let loaded = Arc::new(AtomicBool::new(false));
    let flag = loaded.clone();
    tokio::spawn(registry.run(
        index.clone(),
        Box::new(move || flag.store(true, Ordering::SeqCst)),
    ));
    assert!(
        eventually(|| loaded.load(Ordering::SeqCst)).await,
        "never loaded"
    );
    (index, metrics)
}

#[tokio::test]
async fn routes_come_from_the_gateway_api_crds() {
    let api = ApiServer::default();
    api.routes_installed.store(true, Ordering::SeqCst);
    api.upsert(SERVICES, service());
    api.upsert(HTTPROUTES, http_route("canary", 10));
    // A route for a Gateway only: not the mesh's, not an error.
    let mut gateway_only = http_route("edge-only", 1);
    gateway_only["spec"]["parentRefs"] = serde_json::json!([{"name": "edge"}]);
    api.upsert(HTTPROUTES, gateway_only);
    let (index, metrics) = loaded_registry(&api).await;
    assert_eq!(canary_weight(&index), Some(10));
    let state = index.service(&ServiceKey::new("web", "demo")).unwrap();
    assert_eq!(state.routes.len(), 1, "{:?}", state.routes);
    assert_eq!(metrics.registry_reload_errors.get(), 0);

    // A change arrives through the watch.
    api.upsert(HTTPROUTES, http_route("canary", 30));
    assert!(eventually(|| canary_weight(&index) == Some(30)).await);

    // An invalid version is rejected and the last valid one stays.
    let mut invalid = http_route("canary", 50);
    invalid["spec"]["rules"][0]["matches"][0]["path"] =
        serde_json::json!({"type": "RegularExpression", "value": "(a{100}){100}"});
    api.upsert(HTTPROUTES, invalid);
    assert!(eventually(|| metrics.registry_reload_errors.get() >= 1).await);
    assert_eq!(canary_weight(&index), Some(30));
}

fn policy_object(
    kind: &str,
    version: &str,
    name: &str,
    spec: serde_json::Value,
) -> serde_json::Value {
    serde_json::json!({
        "apiVersion": format!("policy.linkerd.io/{version}"), "kind": kind,
        "metadata": {"name": name, "namespace": "demo"},
        "spec": spec,
    })
}

fn server(port: u16) -> serde_json::Value {
    policy_object(
        "Server",
        "v1beta3",
        "web-http",
        serde_json::json!({"podSelector": {"matchLabels": {"app": "web"}}, "port": port, "proxyProtocol": "HTTP/1"}),
    )
}

#[tokio::test]
async fn policies_come_from_the_linkerd_crds_and_namespace_annotations() {
    use tether_core::policy::{DefaultPolicy, PolicyDoc, PolicyKind, ServerPort, WorkloadKey};
    let api = ApiServer::default();
    api.policies_installed.store(true, Ordering::SeqCst);
    api.upsert(SERVICES, service());
    let mut labelled = pod("web-0");
    labelled.metadata.labels = Some(BTreeMap::from([("app".to_string(), "web".to_string())]));
    api.upsert(PODS, labelled);
    api.upsert(SLICES, slice(&[("10.1.0.5", "web-0", true)]));
    api.upsert(SERVERS, server(8080));
    api.upsert(
        AUTHORIZATION_POLICIES,
        policy_object(
            "AuthorizationPolicy",
            "v1alpha1",
            "web-clients",
            serde_json::json!({
                "targetRef": {"group": "policy.linkerd.io", "kind": "Server", "name": "web-http"},
                "requiredAuthenticationRefs": [{"group": "policy.linkerd.io", "kind": "MeshTLSAuthentication", "name": "clients"}],
            }),
        ),
    );
    api.upsert(
        MESH_TLS,
        policy_object(
            "MeshTLSAuthentication",
            "v1alpha1",
            "clients",
            serde_json::json!({"identities": ["*.demo.serviceaccount.identity.cluster.local"]}),
        ),
    );
    api.upsert(
        POLICY_HTTPROUTES,
        policy_object(
            "HTTPRoute",
            "v1beta3",
            "admin",
            serde_json::json!({
                "parentRefs": [{"group": "policy.linkerd.io", "kind": "Server", "name": "web-http"}],
                "rules": [{"matches": [{"path": {"type": "PathPrefix", "value": "/admin"}}]}],
            }),
        ),
    );
    api.upsert(
        NAMESPACES,
        serde_json::json!({
            "apiVersion": "v1", "kind": "Namespace",
            "metadata": {"name": "demo", "annotations": {"config.linkerd.io/default-inbound-policy": "deny"}},
        }),
    );
    let (index, metrics) = loaded_registry(&api).await;
    // Everything listed is in the policy set when loading completes.
    let set = index.policies();
    assert_eq!(set.namespace_default("demo"), Some(DefaultPolicy::Deny));
    let server_port = |set: &tether_core::policy::PolicySet| match set.get(
        PolicyKind::Server,
        "demo",
        "web-http",
    ) {
        Some(PolicyDoc::Server(s)) => Some(s.port.clone()),
        _ => None,
    };
    assert_eq!(server_port(&set), Some(ServerPort::Number(8080)));
    assert!(set
        .get(PolicyKind::AuthorizationPolicy, "demo", "web-clients")
        .is_some());
    assert!(set
        .get(PolicyKind::MeshTlsAuthentication, "demo", "clients")
        .is_some());
    assert_eq!(set.server_routes.len(), 1, "{:?}", set.server_routes);
    assert_eq!(metrics.registry_reload_errors.get(), 0);
    // The pod's labels are the workload's.
    let web0 = WorkloadKey {
        namespace: "demo".into(),
        name: "web-0".into(),
    };
    assert_eq!(
        index.workload(&web0),
        Some(BTreeMap::from([("app".to_string(), "web".to_string())]))
    );

    // A change arrives through the watch; an invalid version is rejected
    // and the last valid one stays.
    api.upsert(SERVERS, server(9090));
    assert!(eventually(|| server_port(&index.policies()) == Some(ServerPort::Number(9090))).await);
    api.upsert(SERVERS, server(0));
    assert!(eventually(|| metrics.registry_reload_errors.get() >= 1).await);
    assert_eq!(
        server_port(&index.policies()),
        Some(ServerPort::Number(9090))
    );
}

#[tokio::test]
async fn certify_checks_service_account_tokens_through_token_review() {
    use linkerd2_proxy_api::identity::{identity_server::Identity, CertifyRequest};
    use tether_control::identity::{IdentityMetrics, IdentityService, KubeTokenReview, Tokens};

    let api = ApiServer::default();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(api.clone().serve(listener));
    let dir = tempfile::tempdir().unwrap();
    tether_identity::ca::init(&tether_identity::ca::InitOptions::new(
        dir.path(),
        "cluster.local",
    ))
    .unwrap();
    let client = kube::Client::try_from(kube::Config::new(url.parse().unwrap())).unwrap();
    let metrics = IdentityMetrics::default();
    let svc = IdentityService {
        issuer: tokio::sync::watch::channel(Arc::new(
            tether_identity::ca::Issuer::load(dir.path()).unwrap(),
        ))
        .1,
        tokens: Tokens::Kubernetes(KubeTokenReview {
            client,
            audience: "tether.io".into(),
            trust_domain: "cluster.local".into(),
        }),
        leaf_lifetime: Duration::from_secs(60),
        metrics: metrics.clone(),
    };
    let web = "web.demo.serviceaccount.identity.cluster.local";
    let certify = |token: &str, identity: &str| {
        let req = CertifyRequest {
            identity: identity.into(),
            token: token.as_bytes().to_vec(),
            certificate_signing_request: tether_identity::csr::generate(identity).unwrap().csr_der,
        };
        let svc = svc.clone();
        async move { svc.certify(tonic::Request::new(req)).await }
    };

    let issued = certify("sa-token-web", web)
        .await
        .expect("a valid ServiceAccount token is certified");
    assert_eq!(
        tether_identity::cert::dns_names(&issued.into_inner().leaf_certificate),
        vec![web.to_string()]
    );

    let e = certify(
        "sa-token-web",
        "db.demo.serviceaccount.identity.cluster.local",
    )
    .await
    .unwrap_err();
    assert_eq!(e.code(), tonic::Code::PermissionDenied, "{e:?}");
    let e = certify("forged", web).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::Unauthenticated);
    assert!(
        e.message().contains("invalid bearer token"),
        "{}",
        e.message()
    );
    let e = certify("sa-token-other-audience", web).await.unwrap_err();
    assert!(e.message().contains("audience"), "{}", e.message());
}

/// How many times the control plane returned freed memory (the count of
/// `tether_memory_release_seconds`).
fn memory_releases(metrics: &ControlMetrics) -> f64 {
    let mut registry = prometheus_client::registry::Registry::default();
    registry.register("released", "", metrics.memory_releases.clone());
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
    tether_core::prom::parse(&text)
        .iter()
        .find(|s| s.name == "released_count")
        .map_or(0.0, |s| s.value)
}

/// A full list of a large cluster's Pods after `410 Gone` asks for what
/// it freed to be returned; the first list frees nothing held, and does
/// not.
#[tokio::test]
async fn a_large_relist_returns_its_freed_memory() {
    let api = ApiServer::default();
    api.upsert(SERVICES, service());
    for i in 0..10_000 {
        api.upsert(PODS, pod(&format!("web-{i}")));
    }
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(api.clone().serve(listener));

    let metrics = ControlMetrics::default();
    let shutdown = tether_admin::Shutdown::default();
    let memory = tether_control::memory::MemoryRelease::spawn(
        metrics.memory_releases.clone(),
        shutdown.clone(),
    );
    let index = Index::new(metrics.clone());
    let client = kube::Client::try_from(kube::Config::new(url.parse().unwrap())).unwrap();
    let lag = WatchLag::new_with_constructor(tether_control::metrics::LatencyBuckets);
    let registry = KubernetesRegistry::new(client, "cluster.local", metrics.clone(), lag)
        .with_memory_release(memory);
    let loaded = Arc::new(AtomicBool::new(false));
    let flag = loaded.clone();
    tokio::spawn(registry.run(
        index.clone(),
        Box::new(move || flag.store(true, Ordering::SeqCst)),
    ));
    // Listing 10,000 Pods twice in a debug build on a busy machine: a
    // budget of its own.
    let limit = Duration::from_secs(30);
    assert!(
        eventually_within(limit, || loaded.load(Ordering::SeqCst)).await,
        "never loaded"
    );
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(memory_releases(&metrics), 0.0, "the first list asked");

    let lists = api.state.lock().unwrap().lists;
    // Past the compaction point, so one list serves.
    api.compact_and_drop();
    api.upsert(PODS, pod("web-new"));
    assert!(
        eventually_within(limit, || memory_releases(&metrics) == 1.0).await,
        "no memory returned after the Pods were listed again ({} lists before, {} now)",
        lists,
        api.state.lock().unwrap().lists
    );
    shutdown.trigger();
}
