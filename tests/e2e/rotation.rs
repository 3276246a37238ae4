//! Rotation without restarts: a new issuer, and a new trust root in three
//! steps, under open-loop load with no failed request; a bad issuer is
//! refused and the old one kept; `tether check` says where each proxy is.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use tether_identity::rotation::{status, Status, Step};

use crate::support::*;

const WEB: &str = "web.test.serviceaccount.identity.cluster.local";
const CLIENT: &str = "client.test.serviceaccount.identity.cluster.local";
/// Short leaves, so that proxies renew (at 70%) within seconds.
const LEAF_SECS: u64 = 10;

/// How long a proxy may take to move to a new issuer: its next renewal
/// (70% of a leaf's lifetime) with room for a slow machine.
fn renewal_bound() -> Duration {
    Duration::from_secs(3 * LEAF_SECS + 10)
}

/// How long a process may take to re-read a changed file: two looks
/// (500 ms apart), with room for a slow machine.
const RELOAD_BOUND: Duration = Duration::from_secs(10);

/// A control plane, a demo app behind a sidecar (`web`), and a client
/// sidecar, all with identities from `ca`.
struct Rotating {
    scratch: Scratch,
    ca: PathBuf,
    control: Process,
    server: Process,
    client: Process,
    _app: Process,
}

impl Rotating {
    async fn start() -> Self {
        let scratch = Scratch::new();
        scratch.service("web", 8080, false);
        let ca = scratch.identity_init("ca");
        let control = scratch
            .control_with_identity("control", &ca, &LEAF_SECS.to_string())
            .await;
        let app = scratch.demo_app("web-0", 0).await;
        let server = sidecar(&scratch, &ca, "server", WEB, &control, Some(&app)).await;
        let inbound = server.addr("inbound");
        scratch.write(
            "web-0.yaml",
            &format!(
                "kind: Endpoints\nservice: web\nnamespace: test\nendpoints: [{{address: \"{inbound}\", identity: {WEB}}}]\n"
            ),
        );
        let client = sidecar(&scratch, &ca, "client", CLIENT, &control, None).await;
        wait_ready(server.addr("admin")).await;
        wait_ready(client.addr("admin")).await;
        let web = authority("web", 8080);
        assert!(
            eventually(Duration::from_secs(10), || async {
                get(client.addr("outbound"), &web).await.status == 200
            })
            .await,
            "{}",
            scratch.read_log("client")
        );
        Self {
            scratch,
            ca,
            control,
            server,
            client,
            _app: app,
        }
    }

    fn proxies(&self) -> [(&str, SocketAddr); 2] {
        [
            ("server", self.server.addr("admin")),
            ("client", self.client.addr("admin")),
        ]
    }

    /// `tether identity STEP --dir CA`: its output, and the new status.
    fn step(&self, step: &str) -> (String, Status) {
        let dir = self.ca.display().to_string();
        let (ok, out) = run_tether(&["identity", step, "--dir", &dir]);
        assert!(ok, "{step}: {out}");
        (out, status(&self.ca).unwrap())
    }

    /// Waits until the control plane signs with `issuer` and every proxy
    /// holds a certificate from it.
    async fn everyone_uses(&self, issuer: &str) {
        let control = self.control.addr("admin");
        assert!(
            has_label(
                control,
                "tether_identity_issuer_info",
                "issuer",
                issuer,
                RELOAD_BOUND
            )
            .await,
            "control plane never used issuer {issuer}:\n{}",
            self.scratch.read_log("control")
        );
        for (name, admin) in self.proxies() {
            assert!(
                has_label(
                    admin,
                    "tether_identity_cert_issuer_info",
                    "issuer",
                    issuer,
                    renewal_bound()
                )
                .await,
                "{name} never moved to issuer {issuer}:\n{}",
                self.scratch.read_log(name)
            );
        }
    }

    /// Waits until every proxy and the control plane trust exactly `roots`.
    async fn everyone_trusts(&self, roots: &[String]) {
        let mut all = vec![("control", self.control.addr("admin"))];
        all.extend(self.proxies());
        for (name, admin) in all {
            let exactly = eventually(RELOAD_BOUND, || async {
                let mut held =
                    label_values(&metrics(admin).await, "tether_identity_trust_roots", "root");
                held.sort();
                let mut want = roots.to_vec();
                want.sort();
                held == want
            })
            .await;
            assert!(
                exactly,
                "{name} never trusted exactly {roots:?}:\n{}",
                self.scratch.read_log(name)
            );
        }
    }

    /// `tether check` with the identity directory and both proxies.
    fn check(&self) -> String {
        let (grpc, dir) = (
            self.control.addr("grpc").to_string(),
            self.ca.display().to_string(),
        );
        let (server, client) = (
            self.server.addr("admin").to_string(),
            self.client.addr("admin").to_string(),
        );
        let (ok, out) = run_tether(&[
            "check",
            "--control",
            &grpc,
            "--identity",
            &dir,
            "--proxy",
            &server,
            "--proxy",
            &client,
        ]);
        assert!(ok, "{out}");
        out
    }

    /// Requests through a proxy started now (so every connection it makes
    /// is a new handshake, verified with today's roots): it is certified
    /// and reaches `web`.
    async fn fresh_client_reaches_web(&self, name: &str) -> Process {
        let fresh = sidecar(&self.scratch, &self.ca, name, CLIENT, &self.control, None).await;
        wait_ready(fresh.addr("admin")).await;
        let answer = get(fresh.addr("outbound"), &authority("web", 8080)).await;
        assert_eq!(
            answer.status,
            200,
            "{:?}\n{}",
            answer.proxy_error(),
            self.scratch.read_log(name)
        );
        fresh
    }
}

async fn sidecar(
    scratch: &Scratch,
    ca: &Path,
    name: &str,
    identity: &str,
    control: &Process,
    app: Option<&Process>,
) -> Process {
    let args = scratch.identity_args(ca, identity, ca);
    let mut args: Vec<&str> = args.iter().map(String::as_str).collect();
    args.extend(["--tls", "mandatory"]);
    scratch
        .proxy(
            name,
            control.addr("grpc"),
            app.map(|a| a.addr("http")),
            &args,
        )
        .await
}

fn label_values(text: &str, name: &str, label: &str) -> Vec<String> {
    tether_core::prom::parse(text)
        .into_iter()
        .filter(|s| s.name == name && s.value > 0.0)
        .filter_map(|s| s.label(label).map(str::to_string))
        .collect()
}

/// Waits (at most `bound`) until `name{label=value}` is reported at `admin`.
async fn has_label(
    admin: SocketAddr,
    name: &str,
    label: &str,
    value: &str,
    bound: Duration,
) -> bool {
    eventually(bound, || async {
        label_values(&metrics(admin).await, name, label)
            .iter()
            .any(|v| v == value)
    })
    .await
}

/// `tether load` through `outbound`, open loop, until stopped.
struct Load(std::process::Child);

impl Load {
    fn start(outbound: SocketAddr) -> Self {
        let child = std::process::Command::new(tether())
            .args(["load", "--connect", &outbound.to_string()])
            .args(["--authority", &authority("web", 8080)])
            .args(["--rate", "100", "--duration", "600", "--concurrency", "32"])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        Self(child)
    }

    /// Stops the load (SIGTERM) and returns its report.
    fn stop(self) -> serde_json::Value {
        let _ = std::process::Command::new("kill")
            .args(["-TERM", &self.0.id().to_string()])
            .status();
        let out = self.0.wait_with_output().unwrap();
        serde_json::from_slice(&out.stdout)
            .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stdout)))
    }
}

/// Requests the server's sidecar has answered so far (as it counts them).
async fn served(admin: SocketAddr) -> f64 {
    tether_core::prom::parse(&metrics(admin).await)
        .into_iter()
        .filter(|s| {
            s.name == "tether_proxy_requests_total" && s.label("direction") == Some("inbound")
        })
        .map(|s| s.value)
        .sum()
}

/// Waits until the server has answered `more` requests beyond now: load
/// went on after the step just taken.
async fn load_goes_on(server: SocketAddr, more: f64) {
    let before = served(server).await;
    assert!(
        eventually(Duration::from_secs(30), || async {
            served(server).await >= before + more
        })
        .await,
        "no traffic reached the server"
    );
}

fn assert_no_failure(report: &serde_json::Value) {
    assert_eq!(report["failed"], 0, "{report}");
    assert!(report["succeeded"].as_u64().unwrap() > 0, "{report}");
}

#[tokio::test]
async fn a_new_issuer_is_picked_up_under_load_without_a_failed_request() {
    let mesh = Rotating::start().await;
    let before = status(&mesh.ca).unwrap();
    let load = Load::start(mesh.client.addr("outbound"));
    load_goes_on(mesh.server.addr("admin"), 50.0).await;

    let (out, after) = mesh.step("rotate-issuer");
    assert_eq!(after.step, Step::Steady, "{out}");
    assert_ne!(after.issuer, before.issuer);
    assert!(
        out.contains(&format!("new issuer {}", after.issuer)),
        "{out}"
    );
    mesh.everyone_uses(&after.issuer).await;
    load_goes_on(mesh.server.addr("admin"), 50.0).await;
    let _fresh = mesh.fresh_client_reaches_web("fresh").await;
    assert_no_failure(&load.stop());
    let out = mesh.check();
    assert!(
        out.contains(&format!("uses the current issuer {}", after.issuer)),
        "{out}"
    );
}

#[tokio::test]
async fn a_root_is_rotated_in_three_steps_under_load_without_a_failed_request() {
    let mesh = Rotating::start().await;
    let start = status(&mesh.ca).unwrap();
    let load = Load::start(mesh.client.addr("outbound"));
    load_goes_on(mesh.server.addr("admin"), 50.0).await;

    // Step 1: the bundle old + new reaches everyone.
    let began = std::time::Instant::now();
    let (out, one) = mesh.step("rotate-root");
    assert_eq!(one.step, Step::NewRootTrusted, "{out}");
    assert!(out.contains("next: wait until every proxy"), "{out}");
    let new_root = one.next_root.clone().unwrap();
    mesh.everyone_trusts(&one.roots).await;
    eprintln!(
        "step 1 (new root trusted everywhere): {:?}",
        began.elapsed()
    );
    let report = mesh.check();
    assert!(
        report.contains("root rotation: step 1 of 3 done"),
        "{report}"
    );
    for (_, admin) in mesh.proxies() {
        assert!(
            report.contains(&format!("proxy {admin} trusts the new root {new_root}")),
            "{report}"
        );
    }
    // Out of order: dropping the old root before the issuer moved.
    let dir = mesh.ca.display().to_string();
    let (ok, out) = run_tether(&["identity", "finish", "--dir", &dir]);
    assert!(
        !ok && out.contains("step out of order") && out.contains("rotate-issuer"),
        "{out}"
    );
    load_goes_on(mesh.server.addr("admin"), 50.0).await;

    // Step 2: the new issuer, from the new root, reaches everyone.
    let began = std::time::Instant::now();
    let (out, two) = mesh.step("rotate-issuer");
    assert_eq!(two.step, Step::NewIssuer, "{out}");
    mesh.everyone_uses(&two.issuer).await;
    eprintln!(
        "step 2 (every proxy on the new issuer, {LEAF_SECS} s leaves): {:?}",
        began.elapsed()
    );
    let report = mesh.check();
    assert!(
        report.contains("root rotation: step 2 of 3 done"),
        "{report}"
    );
    for (_, admin) in mesh.proxies() {
        assert!(
            report.contains(&format!(
                "proxy {admin} uses the current issuer {}",
                two.issuer
            )),
            "{report}"
        );
    }
    load_goes_on(mesh.server.addr("admin"), 50.0).await;

    // Step 3: only the new root.
    let began = std::time::Instant::now();
    let (out, three) = mesh.step("finish");
    assert_eq!(three.step, Step::Steady, "{out}");
    assert_eq!(three.roots, vec![new_root.clone()]);
    assert!(!three.roots.contains(&start.roots[0]));
    mesh.everyone_trusts(&three.roots).await;
    eprintln!(
        "step 3 (old root dropped everywhere): {:?}",
        began.elapsed()
    );
    load_goes_on(mesh.server.addr("admin"), 50.0).await;
    // A proxy that trusts only the new root is certified by the control
    // plane and reaches the server.
    let _fresh = mesh.fresh_client_reaches_web("fresh").await;
    let report = load.stop();
    eprintln!("load during the root rotation: {report}");
    assert_no_failure(&report);
    assert!(mesh.check().contains("no root rotation under way"));
}

#[tokio::test]
async fn a_bad_issuer_is_refused_and_the_old_one_kept() {
    let mesh = Rotating::start().await;
    let good = status(&mesh.ca).unwrap();
    let other = mesh.scratch.identity_init("other");
    let control = mesh.control.addr("admin");
    let refused = |n: f64| async move {
        eventually(RELOAD_BOUND, || async {
            metric_value(
                &metrics(control).await,
                "tether_identity_reloads_total",
                &[("outcome", "refused")],
            ) >= n
        })
        .await
    };

    // Another issuer's key beside this issuer's certificate.
    let replace = |from: &Path, file: &str| {
        let tmp = mesh.ca.join(format!(".{file}.tmp"));
        std::fs::copy(from.join(file), &tmp).unwrap();
        std::fs::rename(tmp, mesh.ca.join(file)).unwrap();
    };
    replace(&other, "issuer.key");
    assert!(refused(1.0).await, "{}", mesh.scratch.read_log("control"));
    assert!(mesh
        .scratch
        .read_log("control")
        .contains("the key does not match"));
    // A whole issuer from another root.
    replace(&other, "issuer.crt");
    assert!(refused(2.0).await, "{}", mesh.scratch.read_log("control"));
    assert!(mesh
        .scratch
        .read_log("control")
        .contains("does not chain to any root"));

    // The old issuer still signs: a new proxy is certified by it.
    let m = metrics(control).await;
    assert_eq!(
        label_values(&m, "tether_identity_issuer_info", "issuer"),
        vec![good.issuer.clone()],
        "{m}"
    );
    let fresh = mesh.fresh_client_reaches_web("fresh").await;
    assert_eq!(
        label_values(
            &metrics(fresh.addr("admin")).await,
            "tether_identity_cert_issuer_info",
            "issuer"
        ),
        vec![good.issuer.clone()]
    );

    // A trust bundle that does not parse (cut short mid-write, say) is
    // refused by the control plane and by every proxy, which keep trusting
    // the last good one and keep serving.
    let bundle = std::fs::read_to_string(mesh.ca.join("ca.crt")).unwrap();
    let cut = &bundle[..bundle.len() / 2];
    std::fs::write(mesh.ca.join("ca.crt"), cut).unwrap();
    assert!(refused(3.0).await, "{}", mesh.scratch.read_log("control"));
    for (name, admin) in mesh.proxies() {
        let kept = eventually(RELOAD_BOUND, || async {
            metric_value(
                &metrics(admin).await,
                "tether_identity_reloads_total",
                &[("outcome", "refused")],
            ) >= 1.0
        })
        .await;
        assert!(kept, "{name}:\n{}", mesh.scratch.read_log(name));
        let roots = label_values(&metrics(admin).await, "tether_identity_trust_roots", "root");
        assert_eq!(roots, good.roots, "{name}");
    }
    let web = authority("web", 8080);
    for _ in 0..20 {
        assert_eq!(get(mesh.client.addr("outbound"), &web).await.status, 200);
    }
    std::fs::write(mesh.ca.join("ca.crt"), &bundle).unwrap();

    // A good issuer is then taken.
    let (_, rotated) = mesh.step("rotate-issuer");
    assert!(
        has_label(
            control,
            "tether_identity_issuer_info",
            "issuer",
            &rotated.issuer,
            RELOAD_BOUND
        )
        .await
    );
}
