//! The policy APIs.
//!
//! `OutboundPolicies` serves each service port's routes as a full
//! `OutboundPolicy` ([`crate::outbound`]), for a target named by authority
//! (`web.demo.svc.cluster.local:80`) or by the service's `cluster_ip:port`.
//! A watch is a task per stream following the service's routing slot in
//! the index (which changes with routes and settings, not with endpoint
//! churn): it sends a new policy only when the policy changed, through a
//! small bounded channel, so a slow client blocks only itself and skips to
//! the latest policy.
//!
//! A target that is not a mesh service is answered `NotFound` at once:
//! linkerd2-proxy then asks `GetProfile` (which refuses it with
//! `InvalidArgument`, or describes the endpoint for a known pod address) and
//! sends to the original destination, or fails at once when it has none.
//! `InvalidArgument` here would fail every connection to that address
//! (the client treats it as a discovery error), and an answer that is
//! never sent would leave it waiting.
//!
//! Inbound policy is served by [`crate::inbound_policy`], over the same
//! bounded streams ([`RoutingStreams::spawn`]).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use linkerd2_proxy_api::outbound::{
    outbound_policies_server::OutboundPolicies, traffic_spec, OutboundPolicy, TrafficSpec,
};
use tether_admin::Shutdown;
use tether_core::authority::{parse_service_authority, ServiceKey};
use tether_core::truncate::for_log;
use tokio::sync::mpsc;
use tonic::{Request, Response, Status};

use crate::destination::BoxStream;
use crate::index::{Index, ServiceState};
use crate::outbound::Target;

/// Answers buffered per stream before its task waits (on that stream alone).
const STREAM_BUFFER: usize = 2;

/// The streams that follow a service's routing state (policy watches and
/// profiles): how many are live, and how many may be.
#[derive(Clone)]
pub struct RoutingStreams {
    pub index: Index,
    pub shutdown: Shutdown,
    live: Arc<AtomicUsize>,
    max: usize,
}

impl RoutingStreams {
    pub fn new(index: Index, max: usize, shutdown: Shutdown) -> Self {
        Self {
            index,
            shutdown,
            live: Arc::default(),
            max,
        }
    }

    /// How many streams are live.
    pub fn live(&self) -> usize {
        self.live.load(Ordering::Relaxed)
    }

    /// A stream of `build(service state)`, sent at once and again whenever
    /// it changes, until the client goes or the control plane shuts down.
    /// A service that disappears leaves the last answer in force (the last
    /// good state); its discovery says it is gone.
    pub fn follow<T, F>(&self, key: ServiceKey, build: F) -> Result<BoxStream<T>, Status>
    where
        T: PartialEq + Clone + Send + 'static,
        F: Fn(&ServiceState) -> T + Send + 'static,
    {
        let permit = self.acquire()?;
        let source = RoutingSource {
            routing: Some(self.index.watch_routing(&key)),
            index: self.index.clone(),
            service: key,
        };
        Ok(self.spawn(permit, source, move |state| state.map(|s| build(&s))))
    }

    /// A place for one more stream, or why there is none.
    pub(crate) fn acquire(&self) -> Result<StreamPermit, Status> {
        if self.shutdown.is_triggered() {
            return Err(Status::unavailable("control plane is shutting down"));
        }
        if self.live.fetch_add(1, Ordering::Relaxed) >= self.max {
            self.live.fetch_sub(1, Ordering::Relaxed);
            return Err(Status::resource_exhausted(format!(
                "this control plane serves at most {} policy and profile streams (--max-subscriptions); try another replica",
                self.max
            )));
        }
        Ok(StreamPermit {
            live: self.live.clone(),
        })
    }

    /// Sends `build(state)` at once and whenever `source` changes, skipping
    /// answers equal to the last one sent and states that build nothing,
    /// through a small bounded channel (a slow client skips to the latest).
    pub(crate) fn spawn<S, T, F>(
        &self,
        permit: StreamPermit,
        mut source: S,
        build: F,
    ) -> BoxStream<T>
    where
        S: Followed,
        T: PartialEq + Clone + Send + 'static,
        F: Fn(S::State) -> Option<T> + Send + 'static,
    {
        let shutdown = self.shutdown.clone();
        let (tx, rx) = mpsc::channel(STREAM_BUFFER);
        tokio::spawn(async move {
            let _permit = permit;
            let mut sent: Option<T> = None;
            loop {
                if let Some(answer) = build(source.current()) {
                    if sent.as_ref() != Some(&answer) {
                        if tx.send(Ok(answer.clone())).await.is_err() {
                            return;
                        }
                        sent = Some(answer);
                    }
                }
                tokio::select! {
                    changed = source.changed() => if !changed { return },
                    _ = tx.closed() => return,
                    _ = shutdown.triggered() => return,
                }
            }
        });
        Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx))
    }
}

/// What a stream follows: latest-state slots in the index.
pub(crate) trait Followed: Send + 'static {
    type State;
    /// The current state, marking it seen.
    fn current(&mut self) -> Self::State;
    /// Waits for a change; `false` when the source is gone.
    fn changed(&mut self) -> impl std::future::Future<Output = bool> + Send;
}

/// A service's routing slot; gives the slot back when the stream ends.
struct RoutingSource {
    routing: Option<crate::index::RoutingReceiver>,
    index: Index,
    service: ServiceKey,
}

impl Followed for RoutingSource {
    type State = crate::index::RoutingState;

    fn current(&mut self) -> Self::State {
        self.routing
            .as_mut()
            .expect("set until drop")
            .borrow_and_update()
            .clone()
    }

    async fn changed(&mut self) -> bool {
        self.routing
            .as_mut()
            .expect("set until drop")
            .changed()
            .await
            .is_ok()
    }
}

impl Drop for RoutingSource {
    fn drop(&mut self) {
        // The receiver goes first, so the slot is seen unwatched.
        self.routing = None;
        self.index.release_routing(&self.service);
    }
}

/// Gives back a stream's place when it ends, however it ends.
pub(crate) struct StreamPermit {
    live: Arc<AtomicUsize>,
}

impl Drop for StreamPermit {
    fn drop(&mut self) {
        self.live.fetch_sub(1, Ordering::Relaxed);
    }
}

#[derive(Clone)]
pub struct PolicyService {
    pub index: Index,
    pub cluster_domain: String,
    pub streams: RoutingStreams,
}

impl PolicyService {
    pub fn new(streams: RoutingStreams, cluster_domain: &str) -> Self {
        Self {
            index: streams.index.clone(),
            cluster_domain: cluster_domain.to_string(),
            streams,
        }
    }

    /// The service port a target means, or why it is not a mesh service.
    fn resolve(&self, spec: TrafficSpec) -> Result<(ServiceKey, u16), Status> {
        let not_found = |what: String| {
            Status::not_found(format!(
                "{what} is not a mesh service; send to the original destination"
            ))
        };
        match spec.target {
            Some(traffic_spec::Target::Authority(authority)) => {
                let auth = parse_service_authority(&authority, &self.cluster_domain)
                    .map_err(|e| not_found(e.to_string()))?;
                let declared = self
                    .index
                    .service(&auth.service)
                    .is_some_and(|s| s.ports.iter().any(|p| p.port == auth.port));
                if !declared {
                    return Err(not_found(format!(
                        "{} (no such service port)",
                        for_log(&authority)
                    )));
                }
                Ok((auth.service, auth.port))
            }
            Some(traffic_spec::Target::Addr(addr)) => {
                let addr = SocketAddr::try_from(addr)
                    .map_err(|_| Status::invalid_argument("target address is not an IP address"))?;
                let service = self
                    .index
                    .service_by_ip(addr)
                    .ok_or_else(|| not_found(addr.to_string()))?;
                Ok((service, addr.port()))
            }
            None => Err(Status::invalid_argument("TrafficSpec has no target")),
        }
    }

    fn policy(&self, service: &ServiceKey, state: &ServiceState, port: u16) -> OutboundPolicy {
        Target {
            service,
            state,
            port,
            cluster_domain: &self.cluster_domain,
        }
        .policy()
    }
}

#[tonic::async_trait]
impl OutboundPolicies for PolicyService {
    type WatchStream = BoxStream<OutboundPolicy>;

    async fn get(&self, req: Request<TrafficSpec>) -> Result<Response<OutboundPolicy>, Status> {
        let (key, port) = self.resolve(req.into_inner())?;
        let state = self
            .index
            .service(&key)
            .ok_or_else(|| Status::not_found(format!("service {key} is gone")))?;
        Ok(Response::new(self.policy(&key, &state, port)))
    }

    async fn watch(
        &self,
        req: Request<TrafficSpec>,
    ) -> Result<Response<Self::WatchStream>, Status> {
        let (key, port) = self.resolve(req.into_inner())?;
        let (service, domain) = (key.clone(), self.cluster_domain.clone());
        let stream = self.streams.follow(key, move |state| {
            Target {
                service: &service,
                state,
                port,
                cluster_domain: &domain,
            }
            .policy()
        })?;
        Ok(Response::new(stream))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::ControlMetrics;
    use futures::StreamExt;
    use linkerd2_proxy_api::meta::metadata;
    use linkerd2_proxy_api::outbound::{backend, http_route, proxy_protocol};
    use std::time::Duration;
    use tether_core::registry::{parse_documents, Document, EndpointSpec, PortSpec};

    fn web() -> ServiceKey {
        ServiceKey::new("web", "demo")
    }

    fn web_state(routes: &str) -> ServiceState {
        let mut state = ServiceState::new(vec![PortSpec::http(80), {
            let mut p = PortSpec::http(5432);
            p.opaque = true;
            p
        }]);
        state.cluster_ip = Some("10.96.0.10".parse().unwrap());
        state.response_timeout = Some(Duration::from_secs(3));
        state.routes = parse_documents(routes)
            .unwrap()
            .into_iter()
            .filter_map(|d| match d {
                Document::Route(r) => Some(r),
                _ => None,
            })
            .collect();
        state
    }

    fn service(state: ServiceState) -> PolicyService {
        let index = Index::new(ControlMetrics::default());
        index.set_service(&web(), Some(state));
        PolicyService::new(
            RoutingStreams::new(index, 10, Shutdown::default()),
            "cluster.local",
        )
    }

    fn authority(a: &str) -> Request<TrafficSpec> {
        Request::new(TrafficSpec {
            source_workload: "test".into(),
            target: Some(traffic_spec::Target::Authority(a.into())),
        })
    }

    fn addr(a: &str) -> Request<TrafficSpec> {
        Request::new(TrafficSpec {
            source_workload: "test".into(),
            target: Some(traffic_spec::Target::Addr(
                a.parse::<SocketAddr>().unwrap().into(),
            )),
        })
    }

    fn http_routes(p: &OutboundPolicy) -> Vec<linkerd2_proxy_api::outbound::HttpRoute> {
        match p.protocol.as_ref().unwrap().kind.as_ref().unwrap() {
            proxy_protocol::Kind::Detect(d) => {
                assert_eq!(
                    d.http1.as_ref().unwrap().routes,
                    d.http2.as_ref().unwrap().routes
                );
                d.http1.as_ref().unwrap().routes.clone()
            }
            other => panic!("not Detect: {other:?}"),
        }
    }

    fn dst_paths(rule: &http_route::Rule) -> Vec<(String, u32)> {
        let backend_path = |b: &linkerd2_proxy_api::outbound::Backend| match &b.kind {
            Some(backend::Kind::Balancer(p)) => match &p.discovery.as_ref().unwrap().kind {
                Some(backend::endpoint_discovery::Kind::Dst(d)) => d.path.clone(),
                None => panic!("no discovery"),
            },
            other => panic!("not a balancer: {other:?}"),
        };
        match rule.backends.as_ref().unwrap().kind.as_ref().unwrap() {
            http_route::distribution::Kind::FirstAvailable(f) => f
                .backends
                .iter()
                .map(|b| (backend_path(b.backend.as_ref().unwrap()), 1))
                .collect(),
            http_route::distribution::Kind::RandomAvailable(r) => r
                .backends
                .iter()
                .map(|b| {
                    (
                        backend_path(b.backend.as_ref().unwrap().backend.as_ref().unwrap()),
                        b.weight,
                    )
                })
                .collect(),
            http_route::distribution::Kind::Empty(_) => vec![],
        }
    }

    #[tokio::test]
    async fn without_routes_the_default_route_is_todays_behaviour() {
        let svc = service(web_state(""));
        for req in [
            authority("web.demo.svc.cluster.local:80"),
            addr("10.96.0.10:80"),
        ] {
            let policy = svc.get(req).await.unwrap().into_inner();
            let routes = http_routes(&policy);
            assert_eq!(routes.len(), 1);
            assert!(matches!(
                routes[0].metadata.as_ref().unwrap().kind,
                Some(metadata::Kind::Default(ref n)) if n == "http"
            ));
            let rule = &routes[0].rules[0];
            assert_eq!(
                dst_paths(rule),
                vec![("web.demo.svc.cluster.local:80".to_string(), 1)]
            );
            assert_eq!(
                rule.timeouts.as_ref().unwrap().response,
                Some(prost_types::Duration {
                    seconds: 3,
                    nanos: 0
                })
            );
            assert!(rule.retry.is_none());
        }
        let opaque = svc
            .get(authority("web.demo.svc.cluster.local:5432"))
            .await
            .unwrap()
            .into_inner();
        assert!(matches!(
            opaque.protocol.unwrap().kind,
            Some(proxy_protocol::Kind::Opaque(_))
        ));
    }

    #[tokio::test]
    async fn what_is_not_a_mesh_service_is_not_found_at_once() {
        let svc = service(web_state(""));
        for req in [
            authority("nope.demo.svc.cluster.local:80"),
            authority("web.demo.svc.cluster.local:81"),
            authority("example.com:80"),
            addr("10.96.0.10:81"),
            addr("10.1.2.3:80"),
        ] {
            let status = svc.watch(req).await.err().unwrap();
            assert_eq!(status.code(), tonic::Code::NotFound, "{status:?}");
        }
        assert_eq!(svc.streams.live(), 0);
    }

    const CANARY: &str = "kind: HTTPRoute\nname: canary\nnamespace: demo\nparentRefs: [{name: web, port: 80}]\n\
        rules:\n  - matches: [{path: {type: PathPrefix, value: /api}}]\n    backendRefs: [{name: web, weight: 90}, {name: web-v2, weight: 10}]\n    \
        timeouts: {request: 2s}\n    retry: {codes: [503], attempts: 2}\n";

    #[tokio::test]
    async fn routes_are_served_and_updates_follow_routes_not_endpoints() {
        let svc = service(web_state(""));
        let mut stream = svc
            .watch(authority("web.demo.svc.cluster.local:80"))
            .await
            .unwrap()
            .into_inner();
        let first = stream.next().await.unwrap().unwrap();
        assert_eq!(http_routes(&first).len(), 1);

        // Endpoint churn changes nothing a policy says: nothing is sent.
        let mut churned = web_state("");
        churned.endpoints = vec![EndpointSpec::new("127.0.0.1:9".parse().unwrap())].into();
        svc.index.set_service(&web(), Some(churned));
        // A route arrives: the new policy follows.
        svc.index.set_service(&web(), Some(web_state(CANARY)));
        let next = tokio::time::timeout(Duration::from_secs(5), stream.next())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        let routes = http_routes(&next);
        assert_eq!(routes.len(), 1);
        assert!(matches!(
            routes[0].metadata.as_ref().unwrap().kind,
            Some(metadata::Kind::Resource(ref r)) if r.kind == "HTTPRoute" && r.name == "canary"
        ));
        let rule = &routes[0].rules[0];
        assert_eq!(
            dst_paths(rule),
            vec![
                ("web.demo.svc.cluster.local:80".to_string(), 90),
                ("web-v2.demo.svc.cluster.local:80".to_string(), 10)
            ]
        );
        let retry = rule.retry.as_ref().unwrap();
        assert_eq!(retry.max_retries, 2);
        assert_eq!(
            retry.conditions.as_ref().unwrap().status_ranges[0].start,
            503
        );
        assert_eq!(
            rule.timeouts.as_ref().unwrap().request,
            Some(prost_types::Duration {
                seconds: 2,
                nanos: 0
            })
        );
        // The route's rules do not cover `/`: the client answers 404 there,
        // as the Gateway API says; nothing else was sent in between.
        assert!(
            tokio::time::timeout(Duration::from_millis(50), stream.next())
                .await
                .is_err()
        );
        drop(stream);
        assert!(until(|| svc.streams.live() == 0).await);
    }

    #[tokio::test]
    async fn grpc_routes_take_the_port_over() {
        let grpc = "kind: GRPCRoute\nname: greeter\nnamespace: demo\nparentRefs: [{name: web}]\n\
            rules: [{matches: [{method: {service: demo.Greeter}}], retry: {codes: [UNAVAILABLE]}}]\n";
        let svc = service(web_state(&format!("{CANARY}---\n{grpc}")));
        let policy = svc
            .get(authority("web.demo.svc.cluster.local:80"))
            .await
            .unwrap()
            .into_inner();
        let Some(proxy_protocol::Kind::Grpc(g)) = policy.protocol.unwrap().kind else {
            panic!("not gRPC")
        };
        assert_eq!(g.routes.len(), 1);
        assert_eq!(
            g.routes[0].rules[0].matches[0]
                .rpc
                .as_ref()
                .unwrap()
                .service,
            "demo.Greeter"
        );
        assert!(
            g.routes[0].rules[0]
                .retry
                .as_ref()
                .unwrap()
                .conditions
                .as_ref()
                .unwrap()
                .unavailable
        );
        assert!(g.failure_accrual.is_some());
    }

    #[tokio::test]
    async fn watches_are_bounded() {
        let mut svc = service(web_state(""));
        svc.streams.max = 2;
        let mut streams = Vec::new();
        for _ in 0..2 {
            streams.push(
                svc.watch(authority("web.demo.svc.cluster.local:80"))
                    .await
                    .unwrap(),
            );
        }
        let refused = svc
            .watch(authority("web.demo.svc.cluster.local:80"))
            .await
            .err()
            .unwrap();
        assert_eq!(refused.code(), tonic::Code::ResourceExhausted);
        streams.clear();
        assert!(until(|| svc.streams.live() == 0).await);
        assert!(svc
            .watch(authority("web.demo.svc.cluster.local:80"))
            .await
            .is_ok());
    }

    async fn until(mut done: impl FnMut() -> bool) -> bool {
        for _ in 0..500 {
            if done() {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        done()
    }
}
