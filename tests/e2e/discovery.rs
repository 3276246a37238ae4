//! Registry changes reach the proxies' routing without restarts, and the
//! control plane answers every linkerd2-proxy-api call without hanging.

use std::collections::BTreeSet;
use std::time::Duration;

use linkerd2_proxy_api::destination::{
    destination_client::DestinationClient, update, GetDestination, Update,
};
use linkerd2_proxy_api::inbound::{
    inbound_server_policies_client::InboundServerPoliciesClient, PortSpec,
};
use linkerd2_proxy_api::outbound::{
    outbound_policies_client::OutboundPoliciesClient, proxy_protocol, traffic_spec, TrafficSpec,
};

use crate::support::*;

/// Who answered `n` requests: replica names, and `failed STATUS ERROR` for
/// each kind of failure (so a failing request cannot go unnoticed).
async fn replicas_seen(mesh: &Mesh, n: usize) -> BTreeSet<String> {
    let mut seen = BTreeSet::new();
    for _ in 0..n {
        let a = get(mesh.outbound(), &authority("web", 8080)).await;
        if a.status == 200 {
            seen.insert(a.replica().to_string());
        } else {
            seen.insert(format!("failed {} {:?}", a.status, a.proxy_error()));
        }
    }
    seen
}

#[tokio::test]
async fn adding_and_removing_endpoints_moves_traffic() {
    let mesh = Mesh::start(&[0, 0]).await;
    // Start with only web-0 registered.
    mesh.scratch.remove("web-1.yaml");
    assert!(
        eventually(Duration::from_secs(5), || async {
            replicas_seen(&mesh, 10).await == BTreeSet::from(["web-0".to_string()])
        })
        .await
    );

    mesh.scratch
        .endpoint("web-1", "web", mesh.sidecars[1].addr("inbound"), true);
    assert!(
        eventually(Duration::from_secs(5), || async {
            replicas_seen(&mesh, 20).await.contains("web-1")
        })
        .await,
        "added endpoint never received traffic"
    );

    mesh.scratch.remove("web-0.yaml");
    assert!(
        eventually(Duration::from_secs(5), || async {
            replicas_seen(&mesh, 20).await == BTreeSet::from(["web-1".to_string()])
        })
        .await,
        "removed endpoint still received traffic"
    );
}

async fn next(s: &mut tonic::Streaming<Update>) -> Update {
    tokio::time::timeout(Duration::from_secs(5), s.message())
        .await
        .expect("an update within 5s")
        .unwrap()
        .expect("stream still open")
}

#[tokio::test]
async fn destination_streams_full_state_then_diffs() {
    let scratch = Scratch::new();
    scratch.service("web", 80, false);
    let control = scratch.control().await;
    let mut client = DestinationClient::connect(format!("http://{}", control.addr("grpc")))
        .await
        .unwrap();
    let get = |path: String| GetDestination {
        path,
        ..Default::default()
    };
    let mut stream = client
        .get(get(authority("web", 80)))
        .await
        .unwrap()
        .into_inner();
    let first = next(&mut stream).await;
    assert!(
        matches!(first.update, Some(update::Update::NoEndpoints(ref n)) if n.exists),
        "{first:?}"
    );

    scratch.endpoint("web-0", "web", "127.0.0.1:1001".parse().unwrap(), true);
    let add = next(&mut stream).await;
    let Some(update::Update::Add(set)) = add.update else {
        panic!("{add:?}")
    };
    assert_eq!(set.addrs.len(), 1);
    assert_eq!(set.addrs[0].addr.unwrap().port, 1001);

    scratch.remove("web-0.yaml");
    let remove = next(&mut stream).await;
    assert!(
        matches!(remove.update, Some(update::Update::Remove(_))),
        "{remove:?}"
    );
    let none = next(&mut stream).await;
    assert!(
        matches!(none.update, Some(update::Update::NoEndpoints(ref n)) if n.exists),
        "{none:?}"
    );

    // Unknown services: exists=false, and the stream stays open.
    let mut unknown = client
        .get(get(authority("nope", 80)))
        .await
        .unwrap()
        .into_inner();
    let first = next(&mut unknown).await;
    assert!(
        matches!(first.update, Some(update::Update::NoEndpoints(ref n)) if !n.exists),
        "{first:?}"
    );

    // Not a service name at all: a clear error.
    let err = client.get(get("localhost:80".into())).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument);
    assert!(
        err.message().contains("not a service name"),
        "{}",
        err.message()
    );
}

#[tokio::test]
async fn profiles_and_policies_answer_any_client() {
    let scratch = Scratch::new();
    scratch.write(
        "db.yaml",
        "kind: Service\nname: db\nnamespace: test\nports: [{port: 5432, opaque: true}]\nendpoints: [{address: 127.0.0.1:7000}]\n",
    );
    let control = scratch.control().await;
    let url = format!("http://{}", control.addr("grpc"));
    let mut dst = DestinationClient::connect(url.clone()).await.unwrap();
    let t = Duration::from_secs(5);

    let by_name = GetDestination {
        path: authority("db", 5432),
        ..Default::default()
    };
    let mut s = dst.get_profile(by_name).await.unwrap().into_inner();
    let p = tokio::time::timeout(t, s.message())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert!(p.opaque_protocol);
    assert_eq!(p.fully_qualified_name, "db.test.svc.cluster.local");

    let by_ip = GetDestination {
        path: "127.0.0.1:7000".into(),
        ..Default::default()
    };
    let mut s = dst.get_profile(by_ip).await.unwrap().into_inner();
    let p = tokio::time::timeout(t, s.message())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(p.endpoint.unwrap().addr.unwrap().port, 7000);

    let mut outbound = OutboundPoliciesClient::connect(url.clone()).await.unwrap();
    let spec = |target: String| TrafficSpec {
        source_workload: "x".into(),
        target: Some(traffic_spec::Target::Authority(target)),
    };
    let mut s = tokio::time::timeout(t, outbound.watch(spec(authority("db", 5432))))
        .await
        .unwrap()
        .unwrap()
        .into_inner();
    let policy = tokio::time::timeout(t, s.message())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert!(matches!(
        policy.protocol.unwrap().kind,
        Some(proxy_protocol::Kind::Opaque(_))
    ));
    // Not a mesh service: answered at once, so clients go direct.
    let err = tokio::time::timeout(t, outbound.watch(spec(authority("nope", 80))))
        .await
        .unwrap()
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::NotFound);

    let mut inbound = InboundServerPoliciesClient::connect(url).await.unwrap();
    let mut s = tokio::time::timeout(
        t,
        inbound.watch_port(PortSpec {
            workload: "x".into(),
            port: 8080,
        }),
    )
    .await
    .unwrap()
    .unwrap()
    .into_inner();
    let server = tokio::time::timeout(t, s.message())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert!(server.protocol.is_some());
    assert_eq!(server.authorizations.len(), 1);
}

#[tokio::test]
async fn the_audit_runs_every_audit_interval() {
    let scratch = Scratch::new();
    scratch.service("web", 8080, false);
    const INTERVAL: Duration = Duration::from_secs(1);
    let control = scratch
        .control_at(
            "control",
            "127.0.0.1:0",
            &["--audit-interval", &INTERVAL.as_secs().to_string()],
        )
        .await;
    let admin = control.addr("admin");
    let audits = || async {
        metric_value(
            &metrics(admin).await,
            "tether_destination_audits_total",
            &[],
        )
    };
    // Nobody asks (no GET /audit): three audits come on their own, within
    // a generous multiple of the interval.
    assert!(
        eventually(INTERVAL * 10, || async { audits().await >= 3.0 }).await,
        "only {} audits in {:?} with a {INTERVAL:?} interval",
        audits().await,
        INTERVAL * 10
    );
}
