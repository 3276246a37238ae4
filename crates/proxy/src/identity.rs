//! The proxy's own identity: it makes a key and CSR in memory, asks the
//! control plane to certify them, and renews at about 70% of the
//! certificate's lifetime. On failure it retries with backoff while the
//! current certificate stays in use. Readiness waits for the first
//! certificate.
//!
//! The trust bundle (`--trust-root`) is re-read when its file changes
//! ([`follow_bundle`]); a file that does not parse is refused and the last
//! good bundle stays. When the new bundle no longer trusts this proxy's own
//! certificate (the old root was dropped), it renews at once.

use std::path::PathBuf;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::{Duration, SystemTime};
use tether_core::backoff::Backoff;

use linkerd2_proxy_api::identity::{identity_client::IdentityClient, CertifyRequest};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tether_admin::{Readiness, Shutdown};
use tether_identity::tls::CertStore;
use tether_identity::trust::{FileStamps, Trust, TrustBundle};
use tonic::transport::Channel;

/// The readiness condition this module sets.
pub const CERTIFICATE: &str = "certificate";
const BACKOFF_MIN: Duration = Duration::from_millis(200);
const BACKOFF_MAX: Duration = Duration::from_secs(10);

#[derive(Clone, Debug)]
pub struct IdentityConfig {
    /// The identity to ask for, e.g. `web.demo.serviceaccount.identity.cluster.local`.
    pub name: String,
    /// The file holding the token that proves the right to that identity.
    /// It is read at every request: projected ServiceAccount tokens rotate.
    pub token_file: PathBuf,
    /// The trust root (PEM), to verify peers.
    pub trust_root: PathBuf,
}

/// The most a token file may hold: a projected ServiceAccount token is a
/// JWT of 1-2 KiB. It is read at every Certify on the proxy's runtime
/// thread (its only one, with one worker): a path to something endless
/// (`/dev/zero`, a growing log) must not be read forever.
pub const MAX_TOKEN_BYTES: u64 = 64 * 1024;

impl IdentityConfig {
    /// The current token, trimmed.
    pub fn read_token(&self) -> Result<String, String> {
        use std::io::Read;
        let shown = self.token_file.display();
        let mut token = Vec::new();
        std::fs::File::open(&self.token_file)
            .and_then(|f| f.take(MAX_TOKEN_BYTES + 1).read_to_end(&mut token))
            .map_err(|e| format!("reading the token file {shown}: {e}"))?;
        if token.len() as u64 > MAX_TOKEN_BYTES {
            return Err(format!(
                "the token file {shown} holds more than {MAX_TOKEN_BYTES} bytes"
            ));
        }
        let token = String::from_utf8(token)
            .map_err(|_| format!("the token file {shown} is not UTF-8 text"))?;
        Ok(token.trim().to_string())
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabels {
    pub outcome: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct IssuerLabels {
    pub issuer: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RootLabels {
    pub root: String,
}

#[derive(Clone, Default)]
pub struct IdentityMetrics {
    pub expiry: Gauge<f64, AtomicU64>,
    pub renewals: Family<OutcomeLabels, Counter>,
    /// 1 for the issuer of the certificate held (one series).
    pub issuer: Family<IssuerLabels, Gauge>,
    /// 1 for each root of the trust bundle in force.
    pub roots: Family<RootLabels, Gauge>,
    pub reloads: Family<OutcomeLabels, Counter>,
}

impl IdentityMetrics {
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "tether_identity_cert_expiry_timestamp_seconds",
            "When the current certificate expires (unix seconds)",
            self.expiry.clone(),
        );
        registry.register(
            "tether_identity_renewals",
            "Certificate requests by outcome (ok, error)",
            self.renewals.clone(),
        );
        registry.register(
            "tether_identity_cert_issuer_info",
            "The issuer (its fingerprint) of the certificate held, 1",
            self.issuer.clone(),
        );
        registry.register(
            "tether_identity_trust_roots",
            "The roots of the trust bundle in force (their fingerprints), 1 each",
            self.roots.clone(),
        );
        registry.register(
            "tether_identity_reloads",
            "Re-reads of the trust bundle after its file changed, by outcome (ok, refused)",
            self.reloads.clone(),
        );
    }

    /// Shows the roots of `trust` as the ones in force.
    pub fn trusting(&self, trust: &Trust) {
        self.roots.clear();
        for root in &trust.fingerprints {
            self.roots
                .get_or_create(&RootLabels { root: root.clone() })
                .set(1);
        }
    }

    fn issued_by(&self, issuer: String) {
        self.issuer.clear();
        self.issuer.get_or_create(&IssuerLabels { issuer }).set(1);
    }

    fn outcome(&self, outcome: &str) {
        self.renewals
            .get_or_create(&OutcomeLabels {
                outcome: outcome.into(),
            })
            .inc();
    }
}

/// A certificate installed: its expiry and its issuer's fingerprint.
struct Installed {
    expires: SystemTime,
    issuer: String,
}

async fn certify_once(
    client: &mut IdentityClient<Channel>,
    config: &IdentityConfig,
    store: &CertStore,
) -> Result<Installed, String> {
    let kc = tether_identity::csr::generate(&config.name)
        .map_err(|e| format!("making key and CSR: {e}"))?;
    let rsp = client
        .certify(CertifyRequest {
            identity: config.name.clone(),
            token: config.read_token()?.into_bytes(),
            certificate_signing_request: kc.csr_der,
        })
        .await
        .map_err(|s| {
            format!(
                "Certify failed ({:?}): {}",
                s.code(),
                tether_identity::control::status_chain(&s)
            )
        })?
        .into_inner();
    let expires = tether_identity::cert::not_after(&rsp.leaf_certificate)
        .ok_or_else(|| "control plane returned an unreadable certificate".to_string())?;
    let named = tether_identity::cert::dns_names(&rsp.leaf_certificate);
    if named != [config.name.clone()] {
        return Err(format!(
            "control plane certified {named:?}, not {:?}",
            config.name
        ));
    }
    // The chain's first certificate above the leaf signed it.
    let issuer = rsp
        .intermediate_certificates
        .first()
        .map(|der| tether_identity::trust::fingerprint(der))
        .unwrap_or_else(|| "unknown".into());
    store
        .install(
            rsp.leaf_certificate,
            rsp.intermediate_certificates,
            kc.key_pkcs8,
            expires,
        )
        .map_err(|e| e.to_string())?;
    Ok(Installed { expires, issuer })
}

/// Keeps a valid certificate in `store` until shutdown.
pub async fn maintain(
    config: IdentityConfig,
    controls: Arc<crate::discovery::ControlPlanes>,
    store: Arc<CertStore>,
    readiness: Readiness,
    metrics: IdentityMetrics,
    renew_now: Arc<tokio::sync::Notify>,
    shutdown: Shutdown,
) {
    let mut backoff = Backoff::new(BACKOFF_MIN, BACKOFF_MAX);
    let mut next = 0usize;
    loop {
        let attempt = match controls.pick_for_certify(next).await {
            Ok((addr, channel)) => {
                let mut client = IdentityClient::new(channel);
                certify_once(&mut client, &config, &store)
                    .await
                    .map_err(|e| format!("control plane {addr}: {e}"))
            }
            Err(e) => Err(e),
        };
        let wait = match attempt {
            Ok(Installed { expires, issuer }) => {
                metrics.outcome("ok");
                metrics.issued_by(issuer);
                backoff.reset();
                readiness.set(CERTIFICATE, true);
                let secs = expires
                    .duration_since(SystemTime::UNIX_EPOCH)
                    .unwrap_or_default()
                    .as_secs_f64();
                metrics.expiry.set(secs);
                let lifetime = expires
                    .duration_since(SystemTime::now())
                    .unwrap_or_default();
                tracing::info!(identity = %config.name, valid_for = ?lifetime, "certificate installed");
                lifetime.mul_f64(0.7)
            }
            Err(error) => {
                metrics.outcome("error");
                tracing::warn!(%error, "certificate request failed; retrying");
                if !store.has_valid() {
                    readiness.set(CERTIFICATE, false);
                }
                next += 1;
                backoff.next_pause(rand::random())
            }
        };
        tokio::select! {
            _ = tokio::time::sleep(wait) => {}
            _ = renew_now.notified() => {}
            _ = shutdown.triggered() => return,
        }
    }
}

/// How often the trust bundle's file is looked at; a change is read once
/// it has stayed the same for one look, so it applies within two.
pub const BUNDLE_POLL: Duration = Duration::from_millis(500);

/// Re-reads the trust bundle when its file changes from what `stamps` saw
/// (taken before `bundle` was read, so no change is missed), until
/// `shutdown`. A bundle that does not parse is refused (logged once per
/// change, counted) and the last good one stays; a bundle that does not
/// trust this proxy's own certificate any more asks `renew_now`.
pub async fn follow_bundle(
    mut stamps: FileStamps,
    config: IdentityConfig,
    bundle: Arc<TrustBundle>,
    store: Arc<CertStore>,
    renew_now: Arc<tokio::sync::Notify>,
    metrics: IdentityMetrics,
    shutdown: Shutdown,
) {
    loop {
        tokio::select! {
            _ = stamps.next_change(BUNDLE_POLL) => {}
            _ = shutdown.triggered() => return,
        }
        let trust = match Trust::read(&config.trust_root) {
            Ok(trust) => trust,
            Err(e) => {
                metrics
                    .reloads
                    .get_or_create(&OutcomeLabels {
                        outcome: "refused".into(),
                    })
                    .inc();
                tracing::error!(error = %e, roots = ?bundle.current().fingerprints, "trust bundle refused; the last good one stays");
                continue;
            }
        };
        metrics
            .reloads
            .get_or_create(&OutcomeLabels {
                outcome: "ok".into(),
            })
            .inc();
        metrics.trusting(&trust);
        tracing::info!(roots = ?trust.fingerprints, "trust bundle re-read");
        let untrusted = store
            .chain()
            .map(|chain| trust.verifies(&chain, &config.name))
            .is_some_and(|verified| verified.is_err());
        bundle.install(trust);
        if untrusted {
            tracing::warn!(
                "the new trust bundle does not trust this proxy's certificate: renewing now"
            );
            renew_now.notify_one();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tether_identity::ca::{init, InitOptions, Issuer};

    const WEB: &str = "web.test.serviceaccount.identity.cluster.local";
    /// Bounds each wait: the watcher looks every BUNDLE_POLL.
    const SETTLE: Duration = Duration::from_secs(10);

    /// Writes `text` to `path` the documented way: aside, then renamed.
    fn replace(path: &std::path::Path, text: &[u8]) {
        let tmp = path.with_extension("tmp");
        std::fs::write(&tmp, text).unwrap();
        std::fs::rename(tmp, path).unwrap();
    }

    /// Read at every Certify on the proxy's runtime thread (its only one,
    /// with one worker): a token file pointed at something endless must
    /// not be read forever, and the error names the file and the limit.
    #[test]
    fn a_token_file_over_the_limit_is_refused_by_name() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("token");
        std::fs::write(&path, vec![b'a'; 64 * 1024 + 1]).unwrap();
        let config = IdentityConfig {
            name: WEB.into(),
            token_file: path.clone(),
            trust_root: dir.path().join("ca.crt"),
        };
        let err = match config.read_token() {
            Ok(token) => panic!("a token of {} bytes read", token.len()),
            Err(err) => err,
        };
        assert!(
            err.contains(&path.display().to_string()) && err.contains("65536 bytes"),
            "{err}"
        );
        std::fs::write(&path, b" a-token \n").unwrap();
        assert_eq!(config.read_token().unwrap(), "a-token");
    }

    fn count(metrics: &IdentityMetrics, outcome: &str) -> u64 {
        metrics
            .reloads
            .get_or_create(&OutcomeLabels {
                outcome: outcome.into(),
            })
            .get()
    }

    /// A bad bundle file is refused and the last good bundle stays; a
    /// bundle that no longer trusts the proxy's certificate (its root was
    /// dropped) is put in force and asks for a renewal at once.
    #[tokio::test]
    async fn the_bundle_follows_its_file_and_a_dropped_root_renews_at_once() {
        let (old, new) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        init(&InitOptions::new(old.path(), "cluster.local")).unwrap();
        init(&InitOptions::new(new.path(), "cluster.local")).unwrap();
        let file = old.path().join("trust.crt");
        std::fs::copy(old.path().join("ca.crt"), &file).unwrap();
        let store = CertStore::new();
        let key = tether_identity::csr::generate(WEB).unwrap();
        let issued = Issuer::load(old.path())
            .unwrap()
            .sign(&key.csr_der, WEB, Duration::from_secs(3600))
            .unwrap();
        store
            .install(
                issued.leaf_der,
                issued.chain,
                key.key_pkcs8,
                issued.valid_until,
            )
            .unwrap();
        let stamps = FileStamps::new(vec![file.clone()]);
        let bundle = TrustBundle::load(&file).unwrap();
        let first = bundle.current().fingerprints.clone();
        let config = IdentityConfig {
            name: WEB.into(),
            token_file: old.path().join("token"),
            trust_root: file.clone(),
        };
        let (renew_now, metrics, shutdown) = (
            Arc::new(tokio::sync::Notify::new()),
            IdentityMetrics::default(),
            Shutdown::default(),
        );
        tokio::spawn(follow_bundle(
            stamps,
            config,
            bundle.clone(),
            store,
            renew_now.clone(),
            metrics.clone(),
            shutdown.clone(),
        ));

        replace(&file, b"-----BEGIN CERTIFICATE-----\nMIIB");
        let refused = async {
            while count(&metrics, "refused") == 0 {
                tokio::time::sleep(BUNDLE_POLL / 4).await;
            }
        };
        tokio::time::timeout(SETTLE, refused).await.unwrap();
        assert_eq!(
            bundle.current().fingerprints,
            first,
            "the last good bundle stays"
        );

        let only_new = std::fs::read(new.path().join("ca.crt")).unwrap();
        replace(&file, &only_new);
        tokio::time::timeout(SETTLE, renew_now.notified())
            .await
            .expect("a bundle that drops the proxy's root asks for a renewal");
        assert_eq!(count(&metrics, "ok"), 1);
        assert_ne!(bundle.current().fingerprints, first);
        shutdown.trigger();
    }
}
