//! `io.linkerd.proxy.identity.Identity/Certify`: signs a workload's CSR
//! once its bootstrap token proves it may have the identity it asks for.
//!
//! Order of checks: token (who are you?), requested identity (is that what
//! the token allows?), CSR (well-formed, validly signed, naming exactly that
//! identity?), issuer (still valid?). Any refusal signs nothing, answers a
//! gRPC error naming the cause, and is counted by cause.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use linkerd2_proxy_api::identity::{identity_server::Identity, CertifyRequest, CertifyResponse};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tether_identity::ca::{Issuer, IssuerProblem, SignError};
use tether_identity::token::TokenValidator;
use tether_identity::trust::{FileStamps, Trust, TrustBundle};
use tokio::sync::watch;
use tonic::{Request, Response, Status};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CauseLabels {
    pub cause: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct IssuerLabels {
    pub issuer: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RootLabels {
    pub root: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabels {
    pub outcome: String,
}

#[derive(Clone, Default)]
pub struct IdentityMetrics {
    pub issued: Counter,
    pub refusals: Family<CauseLabels, Counter>,
    /// 1 for the issuer in use (one series).
    pub issuer: Family<IssuerLabels, Gauge>,
    pub issuer_expiry: Gauge<f64, std::sync::atomic::AtomicU64>,
    /// 1 for each root of the trust bundle in force.
    pub roots: Family<RootLabels, Gauge>,
    pub reloads: Family<OutcomeLabels, Counter>,
}

impl IdentityMetrics {
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "tether_identity_certificates_issued",
            "Leaf certificates signed",
            self.issued.clone(),
        );
        registry.register(
            "tether_identity_certify_refusals",
            "Certify requests refused, by cause (token, identity, csr_name, malformed_csr, issuer_expired, signing)",
            self.refusals.clone(),
        );
        registry.register(
            "tether_identity_issuer_info",
            "The issuer certificates are signed with (its fingerprint), 1",
            self.issuer.clone(),
        );
        registry.register(
            "tether_identity_issuer_expiry_timestamp_seconds",
            "When the issuer in use expires (unix seconds)",
            self.issuer_expiry.clone(),
        );
        registry.register(
            "tether_identity_trust_roots",
            "The roots of the trust bundle in force (their fingerprints), 1 each",
            self.roots.clone(),
        );
        registry.register(
            "tether_identity_reloads",
            "Re-reads of the identity directory after it changed, by outcome (ok, refused)",
            self.reloads.clone(),
        );
    }

    fn in_use(&self, issuer: &Issuer, trust: &Trust) {
        self.issuer.clear();
        self.issuer
            .get_or_create(&IssuerLabels {
                issuer: issuer.fingerprint().to_string(),
            })
            .set(1);
        self.issuer_expiry
            .set(tether_identity::ca::unix_secs(issuer.not_after()) as f64);
        self.roots.clear();
        for root in &trust.fingerprints {
            self.roots
                .get_or_create(&RootLabels { root: root.clone() })
                .set(1);
        }
    }

    fn reloaded(&self, outcome: &str) {
        self.reloads
            .get_or_create(&OutcomeLabels {
                outcome: outcome.into(),
            })
            .inc();
    }

    fn refuse(&self, cause: &str, status: Status) -> Status {
        self.refusals
            .get_or_create(&CauseLabels {
                cause: cause.into(),
            })
            .inc();
        tracing::warn!(cause, error = %status.message(), "Certify refused");
        status
    }
}

#[derive(Clone)]
pub struct IdentityService {
    /// The issuer in use, replaced when the identity directory changes.
    pub issuer: watch::Receiver<Arc<Issuer>>,
    pub tokens: Tokens,
    pub leaf_lifetime: Duration,
    pub metrics: IdentityMetrics,
}

/// Why Certify cannot be served.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("identity: {0}")]
    Issuer(#[from] tether_identity::ca::LoadError),
    #[error("identity: {0}")]
    Bundle(#[from] tether_identity::tls::TlsError),
    #[error("identity: {0}")]
    Unchained(IssuerProblem),
    #[error("identity: reading bootstrap token secret: {0}")]
    TokenSecret(#[source] std::io::Error),
}

impl IdentityService {
    /// Certify from the identity directory `dir` (`tether identity init`):
    /// its issuer signs; tokens are ServiceAccount tokens checked through
    /// `token_review` when given, else local tokens from `dir`'s secret.
    pub fn load(
        source: &IdentitySource,
        token_review: Option<KubeTokenReview>,
        leaf_lifetime: Duration,
        metrics: IdentityMetrics,
    ) -> Result<Self, StartError> {
        let dir = source.dir.as_path();
        let issuer = source.issuer();
        let tokens = match token_review {
            Some(review) => Tokens::Kubernetes(review),
            None => Tokens::Local(Arc::new(
                tether_identity::token::LocalTokens::load(dir).map_err(StartError::TokenSecret)?,
            )),
        };
        tracing::info!(dir = %dir.display(), "identity: issuing certificates");
        Ok(Self {
            issuer,
            tokens,
            leaf_lifetime,
            metrics,
        })
    }
}

/// The identity directory a control plane signs from: the issuer in use
/// and the trust bundle, both replaced together when the directory
/// changes and the new pair is valid ([`IdentitySource::follow`]).
pub struct IdentitySource {
    pub dir: PathBuf,
    issuer: watch::Sender<Arc<Issuer>>,
    pub bundle: Arc<TrustBundle>,
    /// The files as they were just before they were read.
    stamps: FileStamps,
}

/// How often the identity directory is looked at. A change is read once
/// it has stayed the same for one look, so it applies within two.
pub const IDENTITY_POLL: Duration = Duration::from_millis(500);

/// A directory's issuer and bundle, checked against each other.
fn read_identity(dir: &Path) -> Result<(Issuer, Trust), StartError> {
    let issuer = Issuer::load(dir)?;
    let trust = Trust::read(&dir.join(tether_identity::ca::CA_CERT))?;
    Ok((issuer, trust))
}

impl IdentitySource {
    /// Reads `dir`. An expired issuer is let through (Certify then refuses
    /// with `FAILED_PRECONDITION`, which says what to do); an issuer that
    /// does not chain to the bundle is not.
    pub fn load(dir: &Path, metrics: &IdentityMetrics) -> Result<Self, StartError> {
        use tether_identity::ca::{CA_CERT, ISSUER_CERT, ISSUER_KEY};
        // Before reading, so that a change made meanwhile is read again.
        let stamps = FileStamps::new(
            [ISSUER_CERT, ISSUER_KEY, CA_CERT]
                .iter()
                .map(|f| dir.join(f))
                .collect(),
        );
        let (issuer, trust) = read_identity(dir)?;
        match issuer.check(&trust) {
            Ok(()) => {}
            Err(expired @ IssuerProblem::Expired { .. }) => {
                tracing::error!(error = %expired, "identity: the issuer has expired; Certify will refuse")
            }
            Err(problem) => return Err(StartError::Unchained(problem)),
        }
        metrics.in_use(&issuer, &trust);
        tracing::info!(issuer = %issuer.fingerprint(), not_after = tether_identity::ca::unix_secs(issuer.not_after()), roots = ?trust.fingerprints, "identity: issuer in use");
        Ok(Self {
            dir: dir.to_path_buf(),
            issuer: watch::channel(Arc::new(issuer)).0,
            bundle: TrustBundle::new(trust),
            stamps,
        })
    }

    /// The issuer in use, following every replacement.
    pub fn issuer(&self) -> watch::Receiver<Arc<Issuer>> {
        self.issuer.subscribe()
    }

    /// Re-reads the directory whenever it changes, until `shutdown`: a new
    /// issuer and bundle are put in force together if the issuer is valid
    /// now and chains to a root of the bundle; otherwise the change is
    /// refused with the reason and the last good pair stays.
    pub async fn follow(self, metrics: IdentityMetrics, shutdown: tether_admin::Shutdown) {
        let Self {
            dir,
            issuer: in_use,
            bundle,
            mut stamps,
        } = self;
        loop {
            tokio::select! {
                _ = stamps.next_change(IDENTITY_POLL) => {}
                _ = shutdown.triggered() => return,
            }
            let checked = read_identity(&dir).and_then(|(issuer, trust)| {
                issuer.check(&trust).map_err(StartError::Unchained)?;
                Ok((issuer, trust))
            });
            match checked {
                Ok((issuer, trust)) => {
                    metrics.reloaded("ok");
                    metrics.in_use(&issuer, &trust);
                    tracing::info!(issuer = %issuer.fingerprint(), not_after = tether_identity::ca::unix_secs(issuer.not_after()), roots = ?trust.fingerprints, "identity: issuer in use");
                    bundle.install(trust);
                    if issuer.fingerprint() != in_use.borrow().fingerprint() {
                        in_use.send_replace(Arc::new(issuer));
                    }
                }
                Err(e) => {
                    metrics.reloaded("refused");
                    let kept = in_use.borrow().fingerprint().to_string();
                    tracing::error!(error = %e, issuer = %kept, "identity: the changed identity directory is refused; the issuer in use stays");
                }
            }
        }
    }
}

/// Who vouches for a Certify request's token.
#[derive(Clone)]
pub enum Tokens {
    /// Local bootstrap tokens (`tether identity token`).
    Local(Arc<dyn TokenValidator>),
    /// Kubernetes: a projected ServiceAccount token, checked through the
    /// TokenReview API for the mesh's audience.
    Kubernetes(KubeTokenReview),
}

impl Tokens {
    /// The identity the token allows, or why it allows none.
    pub async fn validate(&self, token: &[u8]) -> Result<String, String> {
        match self {
            Tokens::Local(v) => v.validate(token).map_err(|e| e.to_string()),
            Tokens::Kubernetes(k) => k.validate(token).await,
        }
    }
}

#[derive(Clone)]
pub struct KubeTokenReview {
    pub client: kube::Client,
    pub audience: String,
    pub trust_domain: String,
}

impl KubeTokenReview {
    async fn validate(&self, token: &[u8]) -> Result<String, String> {
        use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec};
        let token = std::str::from_utf8(token)
            .map_err(|_| "token is not UTF-8".to_string())?
            .trim();
        if token.is_empty() {
            return Err("token is empty".into());
        }
        let review = TokenReview {
            spec: TokenReviewSpec {
                token: token.to_string(),
                audiences: Some(vec![self.audience.clone()]),
            },
            ..Default::default()
        };
        let api: kube::Api<TokenReview> = kube::Api::all(self.client.clone());
        let answer = api
            .create(&kube::api::PostParams::default(), &review)
            .await
            .map_err(|e| format!("TokenReview failed: {e}"))?;
        let status = answer.status.unwrap_or_default();
        if status.authenticated != Some(true) {
            return Err(format!(
                "the API server did not authenticate the token{}",
                status.error.map(|e| format!(": {e}")).unwrap_or_default()
            ));
        }
        if !status
            .audiences
            .iter()
            .flatten()
            .any(|a| *a == self.audience)
        {
            return Err(format!("the token is not for audience {:?}", self.audience));
        }
        let username = status.user.and_then(|u| u.username).unwrap_or_default();
        let mut parts = username.split(':');
        match (
            parts.next(),
            parts.next(),
            parts.next(),
            parts.next(),
            parts.next(),
        ) {
            (Some("system"), Some("serviceaccount"), Some(ns), Some(sa), None) => {
                Ok(tether_identity::identity_name(sa, ns, &self.trust_domain))
            }
            _ => Err(format!("{username:?} is not a ServiceAccount")),
        }
    }
}

fn timestamp(t: std::time::SystemTime) -> prost_types::Timestamp {
    let d = t.duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    prost_types::Timestamp {
        seconds: d.as_secs() as i64,
        nanos: d.subsec_nanos() as i32,
    }
}

#[tonic::async_trait]
impl Identity for IdentityService {
    async fn certify(
        &self,
        req: Request<CertifyRequest>,
    ) -> Result<Response<CertifyResponse>, Status> {
        let req = req.into_inner();
        let m = &self.metrics;
        let allowed = self.tokens.validate(&req.token).await.map_err(|e| {
            m.refuse(
                "token",
                Status::unauthenticated(format!("invalid token: {e}")),
            )
        })?;
        if req.identity != allowed {
            return Err(m.refuse(
                "identity",
                Status::permission_denied(format!(
                    "token allows identity {allowed:?}, request asks for {:?}",
                    req.identity
                )),
            ));
        }
        let issuer = self.issuer.borrow().clone();
        let issued = issuer
            .sign(
                &req.certificate_signing_request,
                &allowed,
                self.leaf_lifetime,
            )
            .map_err(|e| match &e {
                SignError::MalformedCsr(_) => {
                    m.refuse("malformed_csr", Status::invalid_argument(e.to_string()))
                }
                SignError::WrongName { .. } => {
                    m.refuse("csr_name", Status::permission_denied(e.to_string()))
                }
                SignError::IssuerExpired(_) => {
                    m.refuse("issuer_expired", Status::failed_precondition(e.to_string()))
                }
                SignError::Signing(_) => m.refuse("signing", Status::internal(e.to_string())),
            })?;
        m.issued.inc();
        tracing::info!(identity = %allowed, "certificate issued");
        Ok(Response::new(CertifyResponse {
            leaf_certificate: issued.leaf_der,
            intermediate_certificates: issued.chain,
            valid_until: Some(timestamp(issued.valid_until)),
        }))
    }
}
