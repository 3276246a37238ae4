//! Heap allocations on the request path, counted by a global allocator
//! that counts per thread: the per-request steps that were made free of
//! allocation (docs/performance.md, "Allocations per request") stay free.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::header::{HeaderMap, HeaderValue, CONNECTION};
use http_body_util::BodyExt;
use tether_proxy::balance::{pick, Balancer};
use tether_proxy::discovery::{Endpoint, Resolution};
use tether_proxy::metrics::{Hop, ProxyMetrics};
use tether_proxy::tls::Connector;

struct Counting;

thread_local! {
    static ALLOCATIONS: Cell<usize> = const { Cell::new(0) };
}

// SAFETY: every call is passed on to the system allocator unchanged; the
// count is a thread-local cell with a constant initialiser and no
// destructor, which itself never allocates.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let _ = ALLOCATIONS.try_with(|n| n.set(n.get() + 1));
        // SAFETY: the caller's contract is the system allocator's.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: as above.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let _ = ALLOCATIONS.try_with(|n| n.set(n.get() + 1));
        // SAFETY: as above.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static COUNTING: Counting = Counting;

/// Allocations `f` makes on this thread.
fn allocations<T>(f: impl FnOnce() -> T) -> (usize, T) {
    let before = ALLOCATIONS.with(Cell::get);
    let out = f();
    (ALLOCATIONS.with(Cell::get) - before, out)
}

/// A balancer over `ports`, and the discovery sender it follows (kept: a
/// closed channel reads as no change).
fn balancer(ports: &[u16]) -> (tokio::sync::watch::Sender<Resolution>, Balancer) {
    let endpoints = ports
        .iter()
        .map(|&port| {
            let addr = SocketAddr::from(([127, 0, 0, 1], port));
            let endpoint = Endpoint {
                addr,
                weight: 1,
                identity: None,
                meshed: true,
                opaque: false,
                labels: Default::default(),
                authority_override: None,
            };
            (addr, endpoint)
        })
        .collect();
    let (tx, rx) = tokio::sync::watch::channel(Resolution::default());
    tx.send_modify(|r| r.endpoints = Arc::new(endpoints));
    let balancer = Balancer::new(
        rx,
        Connector::plain(Duration::from_secs(1)),
        Default::default(),
    );
    (tx, balancer)
}

#[test]
fn taking_the_endpoints_and_picking_one_allocate_nothing() {
    let (_discovery, balancer) = balancer(&[1, 2, 3]);
    // The first call builds the handles (and their clients).
    assert_eq!(balancer.endpoints().len(), 3);
    let (n, endpoints) = allocations(|| balancer.endpoints());
    assert_eq!(n, 0, "taking the endpoints copied them");
    let tried = [endpoints[0].endpoint.addr];
    // The thread's random number generator is made on its first use.
    assert!(pick(&endpoints, &tried).is_some());
    for _ in 0..20 {
        let (n, picked) = allocations(|| pick(&endpoints, &tried));
        assert_eq!(n, 0, "a pick allocated");
        assert_ne!(picked.unwrap().endpoint.addr, tried[0]);
    }
}

#[test]
fn an_empty_body_costs_no_allocation() {
    let (n, body) = allocations(|| tether_proxy::http::full(Bytes::new()));
    assert_eq!(n, 0);
    assert!(hyper::body::Body::is_end_stream(&body));
    let (n, _) = allocations(tether_proxy::http::empty);
    assert_eq!(n, 0);
}

#[test]
fn headers_named_by_connection_go_without_allocating() {
    let mut headers = HeaderMap::with_capacity(8);
    headers.insert(CONNECTION, HeaderValue::from_static("keep-alive, x-hop"));
    headers.insert("keep-alive", HeaderValue::from_static("timeout=5"));
    headers.insert("x-hop", HeaderValue::from_static("1"));
    headers.insert("x-kept", HeaderValue::from_static("1"));
    let (n, ()) = allocations(|| tether_proxy::http::strip_hop_by_hop(&mut headers));
    assert_eq!(n, 0);
    let left: Vec<&str> = headers.keys().map(|k| k.as_str()).collect();
    assert_eq!(left, ["x-kept"]);
}

#[tokio::test(flavor = "current_thread")]
async fn counting_a_response_allocates_nothing_once_its_series_exists() {
    let metrics = ProxyMetrics::default();
    let authority: Arc<str> = "web.demo.svc.cluster.local:80".into();
    let respond = |metrics: &ProxyMetrics| {
        metrics.record_routed_response(
            http::Response::new(tether_proxy::http::empty().into()),
            "outbound",
            authority.clone(),
            None,
            Duration::from_millis(1),
            Hop::default(),
            None,
        )
    };
    // The first response creates its series.
    respond(&metrics).into_body().collect().await.unwrap();
    let (n, rsp) = allocations(|| respond(&metrics));
    assert_eq!(n, 0, "wrapping the response to count it allocated");
    let (n, ()) = allocations(|| drop(rsp));
    assert_eq!(n, 0, "counting the response allocated");
    let mut registry = prometheus_client::registry::Registry::default();
    metrics.register(&mut registry);
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
    assert!(
        text.lines()
            .any(|l| l.starts_with("tether_proxy_requests_total{") && l.ends_with(" 2")),
        "{text}"
    );
}

#[test]
fn rewriting_a_request_for_its_hop_allocates_nothing_once_its_authority_is_parsed() {
    use tether_proxy::http::{rewrite_for_hop, HopAuthority, Proto};
    let authority = HopAuthority::new("web.demo.svc.cluster.local:80");
    let request = || {
        let mut headers = HeaderMap::with_capacity(8);
        headers.insert(http::header::HOST, HeaderValue::from_static("web"));
        let mut req = http::Request::get("/items?page=2")
            .body(tether_proxy::http::empty())
            .unwrap();
        *req.headers_mut() = headers;
        req.into_parts()
    };
    for hop in [Proto::Http2, Proto::Http1] {
        // The first rewrite shares the parsed bytes (one allocation, once).
        let (parts, body) = request();
        drop(rewrite_for_hop(parts, body, &authority, hop, None));
        let (parts, body) = request();
        let (n, req) = allocations(|| rewrite_for_hop(parts, body, &authority, hop, None));
        assert_eq!(n, 0, "rewriting for {hop:?} allocated");
        match hop {
            Proto::Http2 => assert_eq!(
                req.uri(),
                "http://web.demo.svc.cluster.local:80/items?page=2"
            ),
            Proto::Http1 => {
                assert_eq!(req.uri(), "/items?page=2");
                assert_eq!(
                    req.headers()[http::header::HOST],
                    "web.demo.svc.cluster.local:80"
                );
            }
        }
    }
}
