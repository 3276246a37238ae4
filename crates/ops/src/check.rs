//! `tether check`: is this mesh healthy? Each check prints ✔, ⚠ (works,
//! but act soon) or ✘ (broken) with a hint; any ✘ makes the command fail.
//!
//! - every control-plane replica answers, and which version it runs;
//! - replicas agree (services and endpoints in their indexes, and, with a
//!   registry directory, each service's served endpoints);
//! - the trust root and issuer are valid, and for how long;
//! - each proxy is ready, holds a certificate, and runs the same version;
//! - during a rotation (with `--identity`): where it stands, which issuer
//!   each control plane signs with, and, per proxy, which issuer signed its
//!   certificate and whether it trusts the new root, so the operator knows
//!   when the next step is safe.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Duration, SystemTime};

use tether_core::prom;

pub struct CheckOptions {
    pub controls: Vec<String>,
    pub proxies: Vec<SocketAddr>,
    pub identity: Option<PathBuf>,
    pub registry: Option<PathBuf>,
    pub cluster_domain: String,
    /// How to reach the control planes (`identity` is its identity directory).
    pub access: crate::control::ControlAccess,
}

#[derive(Default)]
struct Report {
    failed: usize,
    warned: usize,
}

impl Report {
    fn ok(&mut self, what: String) {
        println!("✔ {what}");
    }
    fn warn(&mut self, what: String, hint: &str) {
        self.warned += 1;
        println!("⚠ {what}\n    hint: {hint}");
    }
    /// Fine, with what to do next.
    fn next(&mut self, what: String, next: &str) {
        println!("✔ {what}\n    next: {next}");
    }
    fn fail(&mut self, what: String, hint: &str) {
        self.failed += 1;
        println!("✘ {what}\n    hint: {hint}");
    }
}

const SOON: Duration = Duration::from_secs(30 * 24 * 3600);

fn expiry(report: &mut Report, what: &str, not_after: Option<SystemTime>, hint: &str) {
    match not_after.map(|t| t.duration_since(SystemTime::now())) {
        None => report.fail(format!("{what}: unreadable"), hint),
        Some(Err(_)) => report.fail(format!("{what}: expired"), hint),
        Some(Ok(left)) if left < SOON => report.warn(
            format!(
                "{what}: expires in {:.1} days",
                left.as_secs_f64() / 86400.0
            ),
            hint,
        ),
        Some(Ok(left)) => report.ok(format!(
            "{what}: valid for {:.0} more days",
            left.as_secs_f64() / 86400.0
        )),
    }
}

/// The values of `label` on every sample of `name` (an info metric).
fn labels(text: &str, name: &str, label: &str) -> Vec<String> {
    prom::parse(text)
        .into_iter()
        .filter(|s| s.name == name && s.value > 0.0)
        .filter_map(|s| s.label(label).map(str::to_string))
        .collect()
}

/// Where a process stands against the identity directory's rotation:
/// which issuer it uses, and whether it trusts the roots it must.
fn rotation_of(
    report: &mut Report,
    who: &str,
    text: &str,
    issuer_metric: &str,
    status: &tether_identity::rotation::Status,
) {
    use tether_identity::rotation::Step;
    let issuers = labels(text, issuer_metric, "issuer");
    let roots = labels(text, "tether_identity_trust_roots", "root");
    match issuers.first() {
        Some(issuer) if *issuer == status.issuer => {
            report.ok(format!("{who} uses the current issuer {issuer}"))
        }
        Some(issuer) => report.warn(
            format!("{who} uses issuer {issuer}, not the current issuer {}", status.issuer),
            "a proxy moves to the new issuer at its next renewal (70% of its certificate's lifetime), \
             a control plane within a second of the directory changing; wait for it before the next step",
        ),
        None => {}
    }
    if roots.is_empty() {
        return;
    }
    match (&status.next_root, status.step) {
        (Some(next), Step::NewRootTrusted | Step::NewIssuer) => {
            if roots.contains(next) {
                report.ok(format!("{who} trusts the new root {next}"));
            } else {
                report.warn(
                    format!("{who} does not trust the new root {next} yet (it trusts {})", roots.join(", ")),
                    "give it the new ca.crt (its --trust-root file; it re-reads it within a second); \
                     wait for it before `tether identity rotate-issuer`",
                );
            }
        }
        _ => {
            let missing: Vec<&String> =
                status.roots.iter().filter(|r| !roots.contains(r)).collect();
            let extra: Vec<&String> = roots.iter().filter(|r| !status.roots.contains(r)).collect();
            if missing.is_empty() && extra.is_empty() {
                report.ok(format!("{who} trusts exactly the roots of ca.crt"));
            } else {
                report.warn(
                    format!("{who} trusts {}, ca.crt holds {}", roots.join(", "), status.roots.join(", ")),
                    "give it the current ca.crt (its --trust-root file); it re-reads it within a second",
                );
            }
        }
    }
}

fn value(text: &str, name: &str) -> Option<f64> {
    prom::parse(text)
        .into_iter()
        .find(|s| s.name == name)
        .map(|s| s.value)
}

/// Runs every check; `Ok(true)` when nothing failed.
pub async fn run(o: &CheckOptions) -> anyhow::Result<bool> {
    let mut report = Report::default();
    let version = env!("CARGO_PKG_VERSION");

    // Control planes: reachable, versions, agreement.
    let mut views = Vec::new();
    for control in &o.controls {
        let fetched = async {
            let channel = o.access.channel(control).await?;
            tether_control::diagnostics::fetch_metrics(channel)
                .await
                .map_err(|s| tether_identity::control::status_chain(&s))
        };
        match tokio::time::timeout(Duration::from_secs(6), fetched).await {
            Ok(Ok(m)) => {
                report.ok(format!(
                    "control plane {control} answers (tether {})",
                    m.version
                ));
                if m.version != version {
                    report.warn(
                        format!(
                            "control plane {control} runs tether {}, this tool is {version}",
                            m.version
                        ),
                        "upgrade proxies and control planes to the same release",
                    );
                }
                views.push((control.clone(), m.text));
            }
            Ok(Err(e)) => report.fail(
                format!("control plane {control}: {e}"),
                "is `tether control` running, and is --grpc this address?",
            ),
            Err(_) => report.fail(
                format!("control plane {control}: timed out"),
                "is the address reachable from here?",
            ),
        }
    }
    if views.len() > 1 {
        let counts: Vec<(String, Option<f64>, Option<f64>)> = views
            .iter()
            .map(|(c, t)| {
                (
                    c.clone(),
                    value(t, "tether_registry_services"),
                    value(t, "tether_registry_endpoints"),
                )
            })
            .collect();
        if counts
            .windows(2)
            .all(|w| w[0].1 == w[1].1 && w[0].2 == w[1].2)
        {
            report.ok(format!(
                "{} replicas agree on services and endpoints",
                counts.len()
            ));
        } else {
            let detail: Vec<String> = counts
                .iter()
                .map(|(c, s, e)| {
                    format!(
                        "{c}: {} services, {} endpoints",
                        s.unwrap_or(-1.0),
                        e.unwrap_or(-1.0)
                    )
                })
                .collect();
            report.fail(
                format!("replicas disagree ({})", detail.join("; ")),
                "compare them: tether diagnostics endpoints AUTHORITY --control A --control B",
            );
        }
    }
    if let Some(dir) = &o.registry {
        match tether_control::registry::file::read_once(dir) {
            Ok((services, rejected)) => {
                for r in &rejected {
                    report.fail(
                        r.clone(),
                        "fix the named file (docs/registry.md); the last good state is served",
                    );
                }
                let mut differing = Vec::new();
                for (key, svc) in &services {
                    for port in &svc.ports {
                        let authority = format!("{}:{}", key.fqdn(&o.cluster_domain), port.port);
                        let (expected, _) =
                            crate::diagnostics::registry_view(dir, &authority, &o.cluster_domain)?;
                        for control in &o.controls {
                            match crate::diagnostics::replica_view(&o.access, control, &authority)
                                .await
                            {
                                Ok(v)
                                    if crate::diagnostics::differences(
                                        "served", &v, "registry", &expected,
                                    )
                                    .is_empty() => {}
                                _ => differing.push(format!("{authority} on {control}")),
                            }
                        }
                    }
                }
                if differing.is_empty() {
                    report.ok(format!(
                        "every replica serves what the registry says ({} services)",
                        services.len()
                    ));
                } else {
                    report.fail(
                        format!("served endpoints differ from the registry: {}", differing.join(", ")),
                        "see tether diagnostics endpoints AUTHORITY --registry DIR; a replica may be stale or rejecting files",
                    );
                }
            }
            Err(e) => report.fail(
                format!("registry {}: {e}", dir.display()),
                "is --registry the control plane's directory?",
            ),
        }
    }

    // Identity.
    let rotation = o
        .identity
        .as_ref()
        .and_then(|dir| tether_identity::rotation::status(dir).ok());
    if let Some(status) = &rotation {
        use tether_identity::rotation::Step;
        let what = match status.step {
            Step::Steady => format!(
                "trust roots {}, issuer {}: no root rotation under way",
                status.roots.join(", "),
                status.issuer
            ),
            Step::NewRootTrusted => format!(
                "root rotation: step 1 of 3 done (ca.crt trusts the old and the new root {})",
                status.next_root.as_deref().unwrap_or("?")
            ),
            Step::NewIssuer => format!(
                "root rotation: step 2 of 3 done (issuer {} is from the new root)",
                status.issuer
            ),
        };
        report.next(what, &status.next());
        for (control, text) in &views {
            rotation_of(
                &mut report,
                &format!("control plane {control}"),
                text,
                "tether_identity_issuer_info",
                status,
            );
        }
    }
    if let Some(dir) = &o.identity {
        let read = |f: &str| {
            std::fs::read_to_string(dir.join(f))
                .ok()
                .and_then(|pem| tether_identity::ca::pem_to_der(&pem))
                .and_then(|der| tether_identity::cert::not_after(&der))
        };
        expiry(
            &mut report,
            "trust root (ca.crt)",
            read(tether_identity::ca::CA_CERT),
            "rotate it step by step: tether identity rotate-root --dir DIR (docs/identity.md)",
        );
        expiry(
            &mut report,
            "issuer (issuer.crt)",
            read(tether_identity::ca::ISSUER_CERT),
            "tether identity rotate-issuer --dir DIR (the control plane picks it up within a second)",
        );
    }

    // Proxies.
    for admin in &o.proxies {
        match tether_mesh_up::stats::http_get(*admin, "/ready").await {
            Ok((200, _)) => report.ok(format!("proxy {admin} is ready")),
            Ok((_, body)) => report.fail(
                format!("proxy {admin} is not ready: {}", body.trim()),
                "a missing certificate means the control plane's Certify failed: see the proxy's log",
            ),
            Err(e) => {
                report.fail(format!("proxy {admin}: {e}"), "is --admin this address?");
                continue;
            }
        }
        if let Ok((200, v)) = tether_mesh_up::stats::http_get(*admin, "/version").await {
            let v = v.trim().trim_start_matches("tether ").to_string();
            if v != version {
                report.warn(
                    format!("proxy {admin} runs tether {v}, this tool is {version}"),
                    "upgrade to one release",
                );
            }
        }
        if let Ok((200, text)) = tether_mesh_up::stats::http_get(*admin, "/metrics").await {
            if let Some(status) = &rotation {
                rotation_of(
                    &mut report,
                    &format!("proxy {admin}"),
                    &text,
                    "tether_identity_cert_issuer_info",
                    status,
                );
            }
            if let Some(secs) = value(&text, "tether_identity_cert_expiry_timestamp_seconds") {
                let at = SystemTime::UNIX_EPOCH + Duration::from_secs_f64(secs.max(0.0));
                let left = at.duration_since(SystemTime::now());
                match left {
                    Ok(left) => report.ok(format!("proxy {admin} certificate valid for {:.0} s more", left.as_secs_f64())),
                    Err(_) => report.fail(
                        format!("proxy {admin} certificate expired"),
                        "renewals are failing: check the proxy's log and the control plane's Certify refusals",
                    ),
                }
            }
        }
    }

    println!("\n{} failed, {} warnings", report.failed, report.warned);
    Ok(report.failed == 0)
}
