//! Transport security between proxies: whether a connection is made over
//! mutual TLS, refused, or (only in opportunistic mode) made in plaintext.
//!
//! | endpoint has an identity? | we hold a certificate? | opportunistic | mandatory |
//! | --- | --- | --- | --- |
//! | yes | yes | mTLS, verifying that identity | mTLS |
//! | yes | no  | plaintext | refused |
//! | no  | —   | plaintext | refused |

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use rustls::pki_types::ServerName;
use rustls::ClientConfig;
use tether_identity::tls::{explain, CertStore};
use tokio::io::{AsyncRead, AsyncWrite};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum TlsMode {
    /// Accept plaintext and TLS; use TLS whenever both sides can.
    #[default]
    Opportunistic,
    /// Never accept or send plaintext between proxies.
    Mandatory,
}

impl std::str::FromStr for TlsMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "opportunistic" => Ok(Self::Opportunistic),
            "mandatory" => Ok(Self::Mandatory),
            _ => Err(format!(
                "unknown TLS mode {s:?}: expected opportunistic or mandatory"
            )),
        }
    }
}

/// Any stream a connection may run over.
pub trait Io: AsyncRead + AsyncWrite + Send + Unpin + 'static {}
impl<T: AsyncRead + AsyncWrite + Send + Unpin + 'static> Io for T {}
pub type BoxedIo = Box<dyn Io>;

pub struct TlsClient {
    pub config: Arc<ClientConfig>,
    /// `config` offering ALPN [`crate::transport_header::ALPN`]: for opaque
    /// TCP to a peer proxy, which then expects a transport header. Plain
    /// `config` offers no ALPN, as linkerd2-proxy's HTTP connections do.
    pub transport_header: Arc<ClientConfig>,
    pub store: Arc<CertStore>,
    pub mode: TlsMode,
}

impl TlsClient {
    /// The TLS of a proxy holding an identity: this client policy (for its
    /// connector) and a server configuration (for accepting mTLS), both
    /// presenting the certificate in `store` and trusting the roots of
    /// `bundle` (consulted at every handshake, so a re-read bundle applies
    /// to new connections).
    pub fn for_identity(
        bundle: Arc<tether_identity::trust::TrustBundle>,
        store: Arc<CertStore>,
        mode: TlsMode,
    ) -> Result<(Arc<Self>, Arc<rustls::ServerConfig>), tether_identity::tls::TlsError> {
        let client = tether_identity::tls::client_config_trusting(store.clone(), bundle.clone())?;
        let server = tether_identity::tls::server_config_trusting(store.clone(), bundle)?;
        let mut transport_header = (*client).clone();
        transport_header.alpn_protocols = vec![crate::transport_header::ALPN.to_vec()];
        Ok((
            Arc::new(Self {
                config: client,
                transport_header: Arc::new(transport_header),
                store,
                mode,
            }),
            server,
        ))
    }
}

/// Makes connections to endpoints, with TLS as policy says.
pub struct Connector {
    pub connect_timeout: Duration,
    pub tls: Option<Arc<TlsClient>>,
}

enum Plan<'a> {
    Plain,
    Tls(&'a str),
    Refuse(String),
}

impl Connector {
    pub fn plain(connect_timeout: Duration) -> Arc<Self> {
        Arc::new(Self {
            connect_timeout,
            tls: None,
        })
    }

    /// Whether plaintext between proxies is forbidden.
    pub fn is_mandatory(&self) -> bool {
        self.tls
            .as_ref()
            .is_some_and(|t| t.mode == TlsMode::Mandatory)
    }

    fn plan<'a>(&self, identity: Option<&'a str>) -> Plan<'a> {
        let Some(tls) = &self.tls else {
            return Plan::Plain;
        };
        let mandatory = tls.mode == TlsMode::Mandatory;
        match identity {
            Some(id) if tls.store.has_valid() => Plan::Tls(id),
            Some(_) if mandatory => Plan::Refuse(
                "this proxy holds no certificate yet; mandatory TLS refuses plaintext".into(),
            ),
            None if mandatory => {
                Plan::Refuse("endpoint has no TLS identity; mandatory TLS refuses plaintext".into())
            }
            _ => Plan::Plain,
        }
    }

    /// Connects to `addr`; returns the stream and whether it is TLS.
    pub async fn connect(
        &self,
        addr: SocketAddr,
        identity: Option<&str>,
    ) -> Result<(BoxedIo, bool), String> {
        self.connect_offering(addr, identity, false)
            .await
            .map(|c| (c.io, c.tls))
    }

    /// Connects to `addr` for opaque TCP to a peer proxy: over mTLS the
    /// connection offers ALPN `transport.l5d.io/v1`, and says whether the
    /// peer accepted it (then it expects a transport header first).
    pub async fn connect_opaque(
        &self,
        addr: SocketAddr,
        identity: Option<&str>,
    ) -> Result<Connected, String> {
        self.connect_offering(addr, identity, true).await
    }

    async fn connect_offering(
        &self,
        addr: SocketAddr,
        identity: Option<&str>,
        transport_header: bool,
    ) -> Result<Connected, String> {
        let plan = self.plan(identity);
        if let Plan::Refuse(reason) = plan {
            return Err(reason);
        }
        let tcp = connect_tcp(addr, self.connect_timeout).await?;
        match (plan, &self.tls) {
            (Plan::Tls(id), Some(tls)) => {
                let name = ServerName::try_from(id.to_string())
                    .map_err(|_| format!("{id:?} is not a valid TLS name"))?;
                let config = if transport_header {
                    &tls.transport_header
                } else {
                    &tls.config
                };
                let connector = tokio_rustls::TlsConnector::from(config.clone());
                let stream =
                    tokio::time::timeout(self.connect_timeout, connector.connect(name, tcp))
                        .await
                        .map_err(|_| format!("TLS handshake with {id} timed out"))?
                        .map_err(|e| explain(&e, id))?;
                let transport_header =
                    stream.get_ref().1.alpn_protocol() == Some(crate::transport_header::ALPN);
                Ok(Connected {
                    io: Box::new(stream),
                    tls: true,
                    transport_header,
                })
            }
            _ => Ok(Connected {
                io: Box::new(tcp),
                tls: false,
                transport_header: false,
            }),
        }
    }
}

/// A connection made by [`Connector::connect_opaque`].
pub struct Connected {
    pub io: BoxedIo,
    pub tls: bool,
    /// The peer agreed on ALPN `transport.l5d.io/v1`: a transport header
    /// must come first.
    pub transport_header: bool,
}

/// A TCP connection to `addr`, within `timeout`, without Nagle's delay.
pub async fn connect_tcp(
    addr: std::net::SocketAddr,
    timeout: std::time::Duration,
) -> Result<tokio::net::TcpStream, String> {
    // Transparent mode: marked as the proxy's own, so `tether init`'s rules
    // leave its packets alone, even after it is closed.
    let connect = tether_identity::own_socket::connect(addr);
    let stream = tokio::time::timeout(timeout, connect)
        .await
        .map_err(|_| format!("connect timed out after {timeout:?}"))?
        .map_err(|e| e.to_string())?;
    let _ = stream.set_nodelay(true);
    Ok(stream)
}

/// How long a client may take to complete a TLS handshake.
pub const HANDSHAKE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// A TLS connection a listener accepted.
pub struct Terminated {
    pub io: BoxedIo,
    /// The client's verified identity.
    pub client_id: Option<Arc<str>>,
    /// Client and server agreed on ALPN `transport.l5d.io/v1`.
    pub transport_header: bool,
}

/// Terminates TLS on an accepted connection whose first bytes (`prefix`)
/// were already read; returns the stream and the client's verified identity.
pub async fn terminate(
    config: Arc<rustls::ServerConfig>,
    prefix: bytes::Bytes,
    stream: tokio::net::TcpStream,
) -> std::io::Result<(BoxedIo, Option<Arc<str>>)> {
    terminate_negotiated(config, prefix, stream)
        .await
        .map(|t| (t.io, t.client_id))
}

/// [`terminate`], also saying what ALPN the client agreed on.
pub async fn terminate_negotiated(
    config: Arc<rustls::ServerConfig>,
    prefix: bytes::Bytes,
    stream: tokio::net::TcpStream,
) -> std::io::Result<Terminated> {
    let acceptor = tokio_rustls::TlsAcceptor::from(config);
    let handshake = acceptor.accept(crate::detect::PrefixedIo::new(prefix, stream));
    let tls = tokio::time::timeout(HANDSHAKE_TIMEOUT, handshake)
        .await
        .map_err(|_| {
            std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("TLS handshake not done within {HANDSHAKE_TIMEOUT:?}"),
            )
        })??;
    let client_id = tls
        .get_ref()
        .1
        .peer_certificates()
        .and_then(|c| c.first())
        .and_then(|c| tether_identity::cert::identity_of(c))
        .map(Arc::from);
    let transport_header = tls.get_ref().1.alpn_protocol() == Some(crate::transport_header::ALPN);
    Ok(Terminated {
        io: Box::new(tls),
        client_id,
        transport_header,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const WEB: &str = "web.demo.serviceaccount.identity.cluster.local";

    /// A connector in `mode`, holding a certificate or not.
    fn connector(mode: TlsMode, certified: bool, dir: &std::path::Path) -> Connector {
        let store = tether_identity::tls::CertStore::new();
        if certified {
            let issuer = tether_identity::ca::Issuer::load(dir).unwrap();
            let key = tether_identity::csr::generate(WEB).unwrap();
            let issued = issuer
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
        }
        let bundle = tether_identity::trust::TrustBundle::load(&dir.join("ca.crt")).unwrap();
        let (tls, _) = TlsClient::for_identity(bundle, store, mode).unwrap();
        Connector {
            connect_timeout: Duration::from_secs(1),
            tls: Some(tls),
        }
    }

    #[test]
    fn when_a_connection_is_mtls_plaintext_or_refused() {
        let dir = tempfile::tempdir().unwrap();
        tether_identity::ca::init(&tether_identity::ca::InitOptions::new(
            dir.path(),
            "cluster.local",
        ))
        .unwrap();
        let no_identity = Connector {
            connect_timeout: Duration::from_secs(1),
            tls: None,
        };
        assert!(matches!(no_identity.plan(Some(WEB)), Plan::Plain));
        assert!(matches!(no_identity.plan(None), Plan::Plain));
        use TlsMode::*;
        // (mode, holds a certificate, endpoint identity) → plan
        let table: [(TlsMode, bool, Option<&str>, &str); 8] = [
            (Opportunistic, true, Some(WEB), "tls"),
            (Opportunistic, true, None, "plain"),
            (Opportunistic, false, Some(WEB), "plain"),
            (Opportunistic, false, None, "plain"),
            (Mandatory, true, Some(WEB), "tls"),
            (
                Mandatory,
                true,
                None,
                "refuse: endpoint has no TLS identity",
            ),
            (
                Mandatory,
                false,
                Some(WEB),
                "refuse: this proxy holds no certificate yet",
            ),
            (
                Mandatory,
                false,
                None,
                "refuse: endpoint has no TLS identity",
            ),
        ];
        for (mode, certified, identity, expected) in table {
            let c = connector(mode, certified, dir.path());
            let got = match c.plan(identity) {
                Plan::Plain => "plain".to_string(),
                Plan::Tls(id) => {
                    assert_eq!(id, WEB);
                    "tls".to_string()
                }
                Plan::Refuse(why) => format!("refuse: {why}"),
            };
            assert!(
                got.starts_with(expected),
                "{mode:?}, certified {certified}, identity {identity:?}: {got}"
            );
            assert_eq!(c.is_mandatory(), mode == Mandatory);
        }
    }
}
