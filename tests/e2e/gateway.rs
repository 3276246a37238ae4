//! The multicluster gateway's admission rules, one test each: mTLS only,
//! only identities of the mesh's trust domain, only `.global` authorities.
//! Each test also shows the same gateway admitting the allowed case, so a
//! refusal cannot come from a gateway that simply does not work.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::support::*;

fn id(name: &str) -> String {
    format!("{name}.test.serviceaccount.identity.cluster.local")
}

const GLOBAL: &str = "web-global.global:8080";

struct GatewayMesh {
    scratch: Scratch,
    ca: PathBuf,
    control: Process,
    _app: Process,
    _server: Process,
}

impl GatewayMesh {
    /// A control plane issuing certificates, and `web` (global id
    /// `web-global`) served by an app behind a sidecar with an identity.
    async fn start() -> Self {
        let scratch = Scratch::new();
        scratch.write(
            "web.yaml",
            "kind: Service\nname: web\nnamespace: test\nports: [{port: 8080}]\nglobal_id: web-global\n",
        );
        let ca = scratch.identity_init("ca");
        let control = scratch.control_with_identity("control", &ca, "3600").await;
        let app = scratch.demo_app("web-0", 0).await;
        let args = scratch.identity_args(&ca, &id("web"), &ca);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let server = scratch
            .proxy(
                "server",
                control.addr("grpc"),
                Some(app.addr("http")),
                &args,
            )
            .await;
        scratch.write(
            "web-0.yaml",
            &format!(
                "kind: Endpoints\nservice: web\nnamespace: test\nendpoints: [{{address: \"{}\", identity: {}}}]\n",
                server.addr("inbound"),
                id("web")
            ),
        );
        Self {
            scratch,
            ca,
            control,
            _app: app,
            _server: server,
        }
    }

    /// A gateway admitting clients of `trust_domain`, once it holds its
    /// certificate.
    async fn gateway(&self, name: &str, trust_domain: &str) -> Process {
        self.scratch
            .gateway(
                name,
                self.control.addr("grpc"),
                &self.ca,
                &id("gateway"),
                trust_domain,
                &[],
            )
            .await
    }

    async fn client_tls(&self) -> Arc<rustls::ClientConfig> {
        certified_client_tls(self.control.addr("grpc"), &self.ca, &id("client")).await
    }
}

/// Requests through `gateway` over mTLS until one is answered 200 (the
/// gateway's discovery of `web` may still be on its way).
async fn admitted(gateway: &Process, tls: &Arc<rustls::ClientConfig>) {
    let last = std::cell::RefCell::new(None);
    let ok = eventually(Duration::from_secs(10), || async {
        let a = tls_get(gateway.addr("gateway"), tls.clone(), &id("gateway"), GLOBAL).await;
        let ok = a
            .as_ref()
            .is_ok_and(|a| a.status == 200 && a.replica() == "web-0");
        *last.borrow_mut() = Some(a.map(|a| (a.status, a.body)).map_err(|e| e.to_string()));
        ok
    })
    .await;
    assert!(
        ok,
        "the gateway did not admit an allowed request: {:?}",
        last.borrow()
    );
}

async fn refused(gateway: &Process, reason: &str) -> f64 {
    metric_value(
        &metrics(gateway.addr("admin")).await,
        "tether_proxy_inbound_refused_total",
        &[("reason", reason)],
    )
}

#[tokio::test]
async fn the_gateway_admits_only_mutual_tls() {
    let mesh = GatewayMesh::start().await;
    let gateway = mesh.gateway("gateway", "cluster.local").await;
    admitted(&gateway, &mesh.client_tls().await).await;

    // Plaintext: closed unanswered.
    let mut plain = tokio::net::TcpStream::connect(gateway.addr("gateway"))
        .await
        .unwrap();
    plain
        .write_all(format!("GET / HTTP/1.1\r\nHost: {GLOBAL}\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut answer = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(10), plain.read_to_end(&mut answer))
        .await
        .expect("the gateway neither answered nor closed");
    assert!(
        read.is_err() || answer.is_empty(),
        "plaintext got an answer: {}",
        String::from_utf8_lossy(&answer)
    );
    assert_eq!(refused(&gateway, "plaintext").await, 1.0);

    // TLS without a client certificate: the handshake is refused.
    let roots = tether_identity::tls::load_roots(&mesh.ca.join("ca.crt")).unwrap();
    let anonymous = rustls::ClientConfig::builder_with_provider(tether_identity::tls::provider())
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    let a = tls_get(
        gateway.addr("gateway"),
        Arc::new(anonymous),
        &id("gateway"),
        GLOBAL,
    )
    .await;
    assert!(a.is_err(), "a client without a certificate was served");
    assert!(
        eventually(Duration::from_secs(5), || async {
            refused(&gateway, "tls_handshake").await == 1.0
        })
        .await,
        "the handshake refusal was not counted"
    );
}

#[tokio::test]
async fn the_gateway_admits_only_identities_of_its_trust_domain() {
    let mesh = GatewayMesh::start().await;
    let tls = mesh.client_tls().await;
    // The same client, certificate and root: admitted by a gateway of its
    // trust domain, refused by one of another.
    let home = mesh.gateway("gateway", "cluster.local").await;
    admitted(&home, &tls).await;
    let elsewhere = mesh.gateway("gateway-elsewhere", "elsewhere.local").await;
    let a = tls_get(
        elsewhere.addr("gateway"),
        tls.clone(),
        &id("gateway"),
        GLOBAL,
    )
    .await;
    assert!(
        a.is_err(),
        "a client outside the trust domain was served: {:?}",
        a.map(|a| (a.status, a.body))
    );
    assert!(
        eventually(Duration::from_secs(5), || async {
            refused(&elsewhere, "foreign_identity").await == 1.0
        })
        .await,
        "the refusal was not counted"
    );
    assert_eq!(refused(&home, "foreign_identity").await, 0.0);
}

#[tokio::test]
async fn the_gateway_routes_only_global_authorities() {
    let mesh = GatewayMesh::start().await;
    let gateway = mesh.gateway("gateway", "cluster.local").await;
    let tls = mesh.client_tls().await;
    admitted(&gateway, &tls).await;
    let local = authority("web", 8080);
    let a = tls_get(gateway.addr("gateway"), tls, &id("gateway"), &local)
        .await
        .unwrap();
    assert_eq!(a.status, 403, "{}", a.body);
    assert_eq!(
        a.proxy_error(),
        Some(format!("the gateway routes only global ids, not {local:?}").as_str())
    );
    assert_eq!(a.replica(), "", "the app was reached");
}
