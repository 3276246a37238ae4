//! Property test: under random registry churn, every live subscriber —
//! fast, slow, stalled then resumed, cancelled and re-subscribed — ends
//! with exactly the registry's view; fast subscribers are never held up by
//! a stalled one; a stalled one catches up with one diff, not a backlog;
//! and the audit finds nothing divergent.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use linkerd2_proxy_api::destination::{update, Update};
use proptest::prelude::*;
use tether_admin::Shutdown;
use tether_control::destination::{DestinationService, Subscriptions};
use tether_control::index::{Index, ServiceState};
use tether_control::metrics::ControlMetrics;
use tether_core::authority::ServiceKey;
use tether_core::registry::{EndpointSpec, PortSpec};
use tonic::Status;

const SERVICES: u8 = 4;
const ENDPOINTS: u8 = 24;

#[derive(Clone, Debug)]
enum Op {
    Add(u8, u8),
    Remove(u8, u8),
    Flip(u8, u8),
    CreateService(u8),
    DeleteService(u8),
}

fn op() -> impl Strategy<Value = Op> {
    let svc = 0..SERVICES;
    let ep = 0..ENDPOINTS;
    prop_oneof![
        4 => (svc.clone(), ep.clone()).prop_map(|(s, e)| Op::Add(s, e)),
        3 => (svc.clone(), ep.clone()).prop_map(|(s, e)| Op::Remove(s, e)),
        3 => (svc.clone(), ep).prop_map(|(s, e)| Op::Flip(s, e)),
        1 => svc.clone().prop_map(Op::CreateService),
        1 => svc.prop_map(Op::DeleteService),
    ]
}

/// The registry, as the test sees it.
#[derive(Default)]
struct Model {
    exists: BTreeSet<u8>,
    endpoints: BTreeMap<u8, BTreeMap<u8, bool>>,
}

fn key(s: u8) -> ServiceKey {
    ServiceKey::new(format!("svc-{s}"), "churn")
}

fn addr(s: u8, e: u8) -> SocketAddr {
    SocketAddr::from(([10, 0, s, e], 80))
}

impl Model {
    fn apply(&mut self, op: &Op) -> u8 {
        match *op {
            Op::Add(s, e) => {
                self.endpoints.entry(s).or_default().insert(e, true);
                s
            }
            Op::Remove(s, e) => {
                self.endpoints.entry(s).or_default().remove(&e);
                s
            }
            Op::Flip(s, e) => {
                if let Some(r) = self.endpoints.entry(s).or_default().get_mut(&e) {
                    *r = !*r;
                }
                s
            }
            Op::CreateService(s) => {
                self.exists.insert(s);
                s
            }
            Op::DeleteService(s) => {
                self.exists.remove(&s);
                s
            }
        }
    }

    fn state(&self, s: u8) -> Option<ServiceState> {
        self.exists.contains(&s).then(|| {
            ServiceState::new(vec![PortSpec::http(80)]).with_endpoints(
                self.endpoints
                    .get(&s)
                    .into_iter()
                    .flatten()
                    .map(|(e, ready)| EndpointSpec {
                        ready: *ready,
                        ..EndpointSpec::new(addr(s, *e))
                    })
                    .collect(),
            )
        })
    }

    /// What a subscriber of `s` must end up seeing.
    fn expected(&self, s: u8) -> View {
        let exists = self.exists.contains(&s);
        View {
            exists: Some(exists),
            endpoints: if exists {
                self.endpoints
                    .get(&s)
                    .into_iter()
                    .flatten()
                    .filter(|(_, ready)| **ready)
                    .map(|(e, _)| addr(s, *e))
                    .collect()
            } else {
                BTreeSet::new()
            },
        }
    }
}

/// A subscriber's picture, built only from the updates it received.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct View {
    exists: Option<bool>,
    endpoints: BTreeSet<SocketAddr>,
}

impl View {
    fn apply(&mut self, up: Update) {
        match up.update {
            Some(update::Update::Add(set)) => {
                for a in set.addrs {
                    let a = a.addr.unwrap();
                    let ip = std::net::IpAddr::try_from(a.ip.unwrap()).unwrap();
                    self.endpoints.insert(SocketAddr::new(ip, a.port as u16));
                }
                self.exists = Some(true);
            }
            Some(update::Update::Remove(set)) => {
                for a in set.addrs {
                    let ip = std::net::IpAddr::try_from(a.ip.unwrap()).unwrap();
                    self.endpoints.remove(&SocketAddr::new(ip, a.port as u16));
                }
            }
            Some(update::Update::NoEndpoints(n)) => {
                self.endpoints.clear();
                self.exists = Some(n.exists);
            }
            None => {}
        }
    }

    fn converged(&self, expected: &View) -> bool {
        self.endpoints == expected.endpoints
            && (!self.endpoints.is_empty() || self.exists == expected.exists)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Fast,
    Slow,
    Stalled,
    Cancelled,
}

struct Subscriber {
    service: u8,
    kind: Kind,
    view: Arc<Mutex<View>>,
    received: Arc<AtomicUsize>,
    paused: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<()>,
}

fn start(dst: &DestinationService, service: u8, kind: Kind) -> Subscriber {
    let mut rx = dst.subscribe(key(service), 80);
    let view = Arc::new(Mutex::new(View::default()));
    let received = Arc::new(AtomicUsize::new(0));
    let paused = Arc::new(AtomicBool::new(false));
    let (v, r, p) = (view.clone(), received.clone(), paused.clone());
    let task = tokio::spawn(async move {
        loop {
            while p.load(Ordering::SeqCst) {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            let Some(msg): Option<Result<Update, Status>> = rx.recv().await else {
                return;
            };
            v.lock().unwrap().apply(msg.unwrap());
            r.fetch_add(1, Ordering::SeqCst);
            if kind == Kind::Slow {
                tokio::time::sleep(Duration::from_millis(3)).await;
            }
        }
    });
    Subscriber {
        service,
        kind,
        view,
        received,
        paused,
        task,
    }
}

async fn run(ops: Vec<Op>) {
    let metrics = ControlMetrics::default();
    let index = Index::new(metrics.clone());
    let subscriptions = Subscriptions::default();
    let dst = DestinationService {
        routing: tether_control::policy::RoutingStreams::new(
            index.clone(),
            usize::MAX,
            Shutdown::default(),
        ),
        index: index.clone(),
        cluster_domain: "cluster.local".into(),
        metrics: metrics.clone(),
        shutdown: Shutdown::default(),
        subscriptions: subscriptions.clone(),
    };
    let mut model = Model::default();
    for s in 0..SERVICES {
        if s % 2 == 0 {
            model.apply(&Op::CreateService(s));
            index.set_service(&key(s), model.state(s));
        }
    }
    let mut subs = Vec::new();
    for s in 0..SERVICES {
        for kind in [
            Kind::Fast,
            Kind::Fast,
            Kind::Fast,
            Kind::Slow,
            Kind::Slow,
            Kind::Stalled,
            Kind::Cancelled,
        ] {
            subs.push(start(&dst, s, kind));
        }
    }
    let apply = |model: &mut Model, op: &Op| {
        let s = model.apply(op);
        index.set_service(&key(s), model.state(s));
    };
    let third = ops.len() / 3;
    for (i, op) in ops[..third].iter().enumerate() {
        apply(&mut model, op);
        if i % 8 == 0 {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }

    // Stall: these subscribers stop reading while churn goes on.
    tokio::time::sleep(Duration::from_millis(20)).await;
    for s in subs.iter().filter(|s| s.kind == Kind::Stalled) {
        s.paused.store(true, Ordering::SeqCst);
    }
    tokio::time::sleep(Duration::from_millis(20)).await;
    let fast_before: usize = subs
        .iter()
        .filter(|s| s.kind == Kind::Fast && s.service == 0)
        .map(|s| s.received.load(Ordering::SeqCst))
        .sum();
    let stalled_before: Vec<usize> = subs
        .iter()
        .filter(|s| s.kind == Kind::Stalled)
        .map(|s| s.received.load(Ordering::SeqCst))
        .collect();
    for (i, op) in ops[third..2 * third].iter().enumerate() {
        apply(&mut model, op);
        if i == third / 2 {
            // Cancel and re-subscribe.
            for sub in subs.iter_mut().filter(|s| s.kind == Kind::Cancelled) {
                sub.task.abort();
                *sub = start(&dst, sub.service, Kind::Cancelled);
            }
        }
        if i % 8 == 0 {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }
    // A change every subscriber of service 0 must see, made last so no
    // later change can undo it (a subscriber that slept through a change
    // and its undoing rightly sees nothing).
    apply(&mut model, &Op::CreateService(0));
    apply(&mut model, &Op::Add(0, ENDPOINTS + 1));
    // Fast subscribers got changes while the stalled ones were stuck.
    let fast_ok = eventually(|| {
        subs.iter()
            .filter(|s| s.kind == Kind::Fast && s.service == 0)
            .map(|s| s.received.load(Ordering::SeqCst))
            .sum::<usize>()
            > fast_before
    })
    .await;
    assert!(fast_ok, "fast subscribers were held up by stalled ones");
    let stalled_now: Vec<usize> = subs
        .iter()
        .filter(|s| s.kind == Kind::Stalled)
        .map(|s| s.received.load(Ordering::SeqCst))
        .collect();
    // (One read may have been under way when the stall began.)
    for (before, now) in stalled_before.iter().zip(&stalled_now) {
        assert!(
            now - before <= 1,
            "stalled subscribers kept reading: {stalled_before:?} → {stalled_now:?}"
        );
    }

    // Resume; a stalled subscriber catches up with what was buffered plus
    // one diff, never the backlog of every change it missed.
    for s in subs.iter().filter(|s| s.kind == Kind::Stalled) {
        s.paused.store(false, Ordering::SeqCst);
    }
    let caught_up = eventually(|| {
        subs.iter()
            .filter(|s| s.kind == Kind::Stalled)
            .all(|s| s.view.lock().unwrap().converged(&model.expected(s.service)))
    })
    .await;
    assert!(caught_up, "stalled subscribers never caught up");
    for (s, now) in subs
        .iter()
        .filter(|s| s.kind == Kind::Stalled)
        .zip(&stalled_now)
    {
        let read = s.received.load(Ordering::SeqCst) - now;
        // Its buffer (4), the rest of the diff it was sending when it stalled
        // (a diff is at most two updates), and one catch-up diff (two).
        assert!(
            read <= 4 + 2 + 2,
            "a resumed subscriber read a backlog of {read} updates"
        );
    }
    for op in &ops[2 * third..] {
        apply(&mut model, op);
    }

    let converged = eventually(|| {
        subs.iter()
            .all(|s| s.view.lock().unwrap().converged(&model.expected(s.service)))
    })
    .await;
    for s in &subs {
        let view = s.view.lock().unwrap().clone();
        assert!(
            view.converged(&model.expected(s.service)),
            "{:?} subscriber of svc-{} ended with {view:?}, registry has {:?}",
            s.kind,
            s.service,
            model.expected(s.service)
        );
    }
    assert!(converged);
    let report = subscriptions.audit(&index, &metrics);
    assert_eq!(report.divergent, 0, "{report}");
    assert_eq!(report.stale_slots, 0, "{report}");
    assert_eq!(report.subscriptions, subs.len());
    assert_eq!(metrics.divergent_subscriptions.get(), 0);
    for s in subs {
        s.task.abort();
    }
}

async fn eventually(mut check: impl FnMut() -> bool) -> bool {
    for _ in 0..500 {
        if check() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    false
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn every_subscriber_converges_under_churn(ops in proptest::collection::vec(op(), 60..400)) {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        rt.block_on(run(ops));
    }
}
