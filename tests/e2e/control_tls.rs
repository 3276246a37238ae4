//! TLS between proxies and the control plane: impostors are refused, one
//! side in plaintext is named, and every API but Certify needs a client
//! certificate.

use std::path::Path;
use std::time::Duration;

use linkerd2_proxy_api::destination::{destination_client::DestinationClient, GetDestination};

use crate::support::*;

const WEB: &str = "web.test.serviceaccount.identity.cluster.local";

/// How long a proxy's first certificate request may take to fail and be
/// logged (its first attempt is immediate; retries start at 200 ms).
const FIRST_ATTEMPT: Duration = Duration::from_secs(10);

async fn control(scratch: &Scratch, name: &str, ca: &Path, extra: &[&str]) -> Process {
    scratch.control_with_identity_and(name, ca, extra).await
}

/// Waits until `name`'s log contains `text`; whether it did.
async fn logged(scratch: &Scratch, name: &str, text: &str) -> bool {
    eventually(FIRST_ATTEMPT, || async {
        scratch.read_log(name).contains(text)
    })
    .await
}

#[tokio::test]
async fn a_proxy_refuses_an_impostor_control_plane_and_stays_not_ready() {
    let scratch = Scratch::new();
    let ca = scratch.identity_init("ca");
    let other_root = scratch.identity_init("other");
    // Another trust root, and the right root with another identity.
    let rogue = control(&scratch, "rogue", &other_root, &[]).await;
    let misnamed = control(
        &scratch,
        "misnamed",
        &ca,
        &[
            "--control-identity",
            "tether-control.evil.serviceaccount.identity.cluster.local",
        ],
    )
    .await;
    let args = scratch.identity_args(&ca, WEB, &ca);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let to_rogue = scratch
        .proxy("to-rogue", rogue.addr("grpc"), None, &args)
        .await;
    let to_misnamed = scratch
        .proxy("to-misnamed", misnamed.addr("grpc"), None, &args)
        .await;

    assert!(
        logged(&scratch, "to-rogue", "does not chain to the trust root").await,
        "{}",
        scratch.read_log("to-rogue")
    );
    assert!(
        logged(
            &scratch,
            "to-misnamed",
            "expected tether-control.tether-system.serviceaccount.identity.cluster.local"
        )
        .await,
        "{}",
        scratch.read_log("to-misnamed")
    );
    for (name, proxy) in [("to-rogue", &to_rogue), ("to-misnamed", &to_misnamed)] {
        let log = scratch.read_log(name);
        assert!(log.contains("impostor refused"), "{log}");
        let (status, body) = ready_body(proxy.addr("admin")).await;
        assert_eq!(status, 503, "{name}: {body}");
        assert!(body.contains("certificate"), "{name}: {body}");
    }
    // Nothing was signed for the impostors' clients.
    let m = metrics(misnamed.addr("admin")).await;
    assert_eq!(
        metric_value(&m, "tether_identity_certificates_issued_total", &[]),
        0.0,
        "{m}"
    );
}

#[tokio::test]
async fn one_side_in_plaintext_is_named_on_both_sides() {
    let scratch = Scratch::new();
    scratch.service("web", 8080, false);
    let ca = scratch.identity_init("ca");

    // A plaintext proxy against a TLS-only control plane is told why.
    let tls_only = control(&scratch, "tls-only", &ca, &[]).await;
    let plain = scratch
        .proxy(
            "plain",
            tls_only.addr("grpc"),
            None,
            &["--insecure-control-plane"],
        )
        .await;
    let web = authority("web", 8080);
    assert_eq!(get(plain.addr("outbound"), &web).await.status, 503);
    assert!(
        logged(
            &scratch,
            "plain",
            "requires TLS, but the client connected in plaintext"
        )
        .await,
        "{}",
        scratch.read_log("plain")
    );

    // A TLS proxy against a plaintext-only control plane names it too.
    let plaintext_only = scratch.control().await;
    let args = scratch.identity_args(&ca, WEB, &ca);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let tls = scratch
        .proxy("tls", plaintext_only.addr("grpc"), None, &args)
        .await;
    assert!(
        logged(&scratch, "tls", "it does not speak TLS").await,
        "{}",
        scratch.read_log("tls")
    );
    assert_eq!(ready_body(tls.addr("admin")).await.0, 503);
}

#[tokio::test]
async fn discovery_needs_a_client_certificate_and_certify_does_not() {
    let scratch = Scratch::new();
    scratch.service("web", 8080, false);
    let ca = scratch.identity_init("ca");
    let control = scratch.control_with_identity("control", &ca, "60").await;
    let get = GetDestination {
        path: authority("web", 8080),
        ..Default::default()
    };

    // Server-authenticated TLS (what Certify takes) is not enough.
    let status = DestinationClient::new(certify_channel(control.addr("grpc"), &ca))
        .get(get.clone())
        .await
        .unwrap_err();
    assert_eq!(status.code(), tonic::Code::Unauthenticated, "{status:?}");
    assert!(
        status.message().contains("needs mutual TLS"),
        "{}",
        status.message()
    );

    // Plaintext is refused with a reason.
    let plain = tether_identity::control::channel(control.addr("grpc"), None);
    let status = DestinationClient::new(plain).get(get).await.unwrap_err();
    assert_eq!(status.code(), tonic::Code::Unauthenticated, "{status:?}");
    assert!(
        status.message().contains("requires TLS"),
        "{}",
        status.message()
    );

    // A proxy certified over the same port then discovers over mutual TLS.
    let app = scratch.demo_app("web-0", 0).await;
    let args = scratch.identity_args(&ca, WEB, &ca);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let proxy = scratch
        .proxy("proxy", control.addr("grpc"), Some(app.addr("http")), &args)
        .await;
    scratch.endpoint("web-0", "web", proxy.addr("inbound"), true);
    wait_ready(proxy.addr("admin")).await;
    assert!(
        eventually(Duration::from_secs(5), || async {
            get_status(proxy.addr("outbound"), &authority("web", 8080)).await == 200
        })
        .await,
        "{}",
        scratch.read_log("proxy")
    );
}

async fn get_status(outbound: std::net::SocketAddr, authority: &str) -> u16 {
    get(outbound, authority).await.status.as_u16()
}
